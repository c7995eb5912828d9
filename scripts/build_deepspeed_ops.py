"""Builds the DeepSpeed C++ ops the test suite runs (CPU Adam; on the CPU accelerator its shared-memory comm op too)
once, into torch's extension cache ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), where DeepSpeed's JIT
loader finds them. Without this step the first test that needs an op compiles it inside the suite (minutes on two
cores, ~2 GB per compiler process, one xdist worker waiting on the other's lock). Idempotent: a cached op loads in
about a second. A machine without a C++ toolchain gets one line and exit 0: the tests that need the ops skip or say
why."""

from __future__ import annotations

import sys
import time

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def main() -> int:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as error:
        print(f"build_deepspeed_ops: deepspeed is not installed ({error}); nothing to build", file=sys.stderr)
        return 0
    accelerator = get_accelerator()
    for name in OPS:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"build_deepspeed_ops: {name} does not apply to the {accelerator.device_name()} accelerator")
            continue
        started = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as error:  # noqa: BLE001 - a compiler error of any kind: report it, the tests skip
            print(f"build_deepspeed_ops: {name} did not build: {str(error).splitlines()[0] if str(error) else error}",
                  file=sys.stderr)
            continue
        print(f"build_deepspeed_ops: {builder.name} ready ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
