import os
import sys

# The Triton kernels run on the CPU through Triton's interpreter; it is chosen when the kernels are
# defined, so this must happen before spikingjelly_mfpsn (and with it triton) is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--zoo", choices=("families", "all"), default="families",
                     help="tests/test_zoo.py: one network of each SpikingJelly model-zoo family (default), "
                          "or every constructor of the zoo (slower: the VGGs have about 130M parameters)")


def pytest_generate_tests(metafunc):
    if "zoo_name" in metafunc.fixturenames:
        import zoo
        names = list(zoo.ZOO) if metafunc.config.getoption("zoo") == "all" else list(zoo.FAMILIES.values())
        metafunc.parametrize("zoo_name", names)
