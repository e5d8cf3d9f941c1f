"""The paper's networks and data readers, for the examples and benchmarks: not part of the library's API
(the neuron, its ops, layers, conversion, autoselect and deployment), which never imports them."""
