"""The ``races`` check: DMAs in flight while their buffers are read or written.

A kernel on one core stays in the plain interpreter, where the check is made inside the plain
interpretation (``dma_races``, lowered by ``checked_plain``). A kernel in TPU interpret mode (chosen
for it, or forced) or in the Mosaic-GPU interpreter runs with that interpreter's detector on
(``interpreters.candidates``); after the run, the detector's verdict becomes a finding.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from pallas_guard._checks import dma_races as _dma_races
from pallas_guard._checks import protocol as _checks
from pallas_guard._checks.checked_plain import Active, PlainLowering
from pallas_guard._checks.dma_jaxpr import has_dmas
from pallas_guard._checks.dma_table import Instrumented, Unsupported
from pallas_guard._deciding import diagnostics as _diagnostics
from pallas_guard._jax import pallas as jax_pallas
from pallas_guard._running import findings as _findings
from pallas_guard._vocabulary import record as _record
from pallas_guard._vocabulary.errors import PallasGuardError

if TYPE_CHECKING:
    from pallas_guard._guard.engine import Run


class Races(_checks.Check):
    name = "races"
    order = 3
    in_plain = True

    def arm_plain(self, lowering: PlainLowering) -> Active | None:
        """The kernel traced again with its DMA table; None where its DMAs cannot race (decided
        while tracing) or cannot be followed (its decision says why)."""
        if not has_dmas(lowering.params["jaxpr"]):
            return None
        races = Instrumented()
        try:
            lowering.params = _dma_races.instrument(lowering.params, races)
        except Unsupported as why:
            kernel, call_site = lowering.kernel, lowering.call_site
            note = f"runs unchecked: races could not be checked: {why}"
            _record.annotate(
                kernel, call_site, _checks.unchecked("races", str(why), kernel=kernel, call_site=call_site, note=note)
            )
            return None
        if not races.points:  # race-free whichever way it runs, decided while tracing
            return None
        lowering.state[self.name] = races
        return contextlib.nullcontext

    def plain_finding(
        self, message: str, lowering: PlainLowering, source: str, call_site: _diagnostics.CallSite
    ) -> PallasGuardError | None:
        races = lowering.state.get(self.name)
        if races is None or not _dma_races.is_race(message):
            return None
        what, text = _dma_races.describe(message, races)
        return _diagnostics.race_finding(text, what=what, kernel=lowering.kernel, call_site=call_site, source=source)

    def after(self, run: Run, out: Any, interpreter: str) -> None:
        # Only the interpreter that ran with the detector has a race state to read: a kernel the
        # detector could not take (plain, forced or chosen) has none.
        if run.candidates.detect_races and interpreter in ("tpu", "gpu"):
            check(out, kernel=run.kernel.info, call_site=run.call_site, interpreter=interpreter)


def check(out: Any, *, kernel: _diagnostics.KernelInfo, call_site: _diagnostics.CallSite, interpreter: str) -> None:
    """Raise the finding if the interpreter found a race running the kernel.

    Run eagerly, the kernel has finished when this returns and the finding is raised here; traced
    (under jit), a callback that depends on the kernel's output checks after it ran and records the
    finding, which the jitted call raises. Raised there, it stops the computation before the
    interpreter's own clean-up (ordered after the outputs): the guard resets the interpreter first,
    so the next kernel starts clean.
    """
    import jax

    def finding() -> PallasGuardError | None:
        if not jax_pallas.races_found(interpreter):
            return None
        jax_pallas.reset_interpreter(interpreter)
        error = _diagnostics.race_error(kernel=kernel, call_site=call_site, interpreter=interpreter)
        return _checks.found("races", error, kernel=kernel, call_site=call_site, interpreter=interpreter)

    def record_if_race(*_: Any) -> None:
        found = finding()
        if found is not None:
            _findings.record(found)

    leaves = jax.tree_util.tree_leaves(out)
    if not leaves:
        return
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        jax.debug.callback(record_if_race, leaves[0])
        return
    jax.block_until_ready(out)  # type: ignore[no-untyped-call]
    found = finding()
    if found is not None:
        raise found


CHECK = Races()
