"""What autoselect measured and chose: :class:`AutoselectReport`, printed as a table."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LayerResult:
    """One layer of an :class:`AutoselectReport` in one layout.

    ``name`` and ``kind``: the layer's module name and type name; ``times``: seconds per candidate method;
    ``choice``: the method kept; ``cached``: whether the times came from the timing cache.
    """

    name: str
    kind: str
    times: dict[str, float]
    choice: str
    cached: bool = False


@dataclass
class AutoselectReport:
    """What autoselect measured and chose. ``print(report)`` shows a table."""

    layouts: dict[str, list[LayerResult]] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    layout: Optional[str] = None
    methods: dict[str, str] = field(default_factory=dict)
    timed: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    compiled: bool = False
    compile_times: dict[str, float] = field(default_factory=dict)
    compile_backend: Optional[str] = None
    forward_only: bool = False

    def __str__(self) -> str:
        lines = [f"autoselect: layout {self.layout!r} "
                 f"({', '.join(f'{k} {v * 1e3:.3f} ms' for k, v in self.totals.items())}); "
                 f"{self.timed} timed, {self.cache_hits} cached, {self.seconds:.2f} s"
                 + ("; forward passes only (gradients disabled)" if self.forward_only else "")]
        for layout, rows in self.layouts.items():
            lines.append(f"[{layout}]{' (chosen)' if layout == self.layout else ''}")
            lines.append(f"  {'layer':<28} {'type':<26} {'choice':<12} candidates (ms)")
            for r in rows:
                cands = ", ".join(f"{k}={v * 1e3:.3f}" for k, v in sorted(r.times.items(), key=lambda kv: kv[1]))
                lines.append(f"  {r.name:<28} {r.kind:<26} {r.choice:<12} {cands}{' [cache]' if r.cached else ''}")
        if self.compile_times:
            lines.append("whole network, " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.compile_times.items())
                         + f": {'compiled' if self.compiled else 'eager'} ({self.compile_backend})")
        lines += [f"skipped: {s}" for s in self.skipped]
        return "\n".join(lines)
