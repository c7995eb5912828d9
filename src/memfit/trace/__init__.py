"""`memfit trace`: the exact tensor memory of a real training step, run on fake tensors (no GPU, no weights);
`trace_script(argv)`: the same for the user's own training script (memfit.trace.script).

`from memfit.trace import trace` imports torch only when `trace` is first used, so `import memfit` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import MissingDependencyError

if TYPE_CHECKING:
    from .estimator import traced_estimator
    from .run import trace
    from .script import trace_script
    from .timeline import TraceProgress

__all__ = ["TraceProgress", "trace", "trace_script", "traced_estimator"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'memfit.trace' has no attribute {name!r}")
    try:
        from . import estimator, run, script, timeline
    except ImportError as error:
        raise MissingDependencyError(f"memfit trace needs torch ({error.name or error}): "
                                     "pip install 'memfit[torch]'") from error
    return {"trace": run.trace, "traced_estimator": estimator.traced_estimator,
            "TraceProgress": timeline.TraceProgress, "trace_script": script.trace_script}[name]
