"""Sizes. Bytes are `int` everywhere inside memfit; GiB/GB appear only when a number is shown."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 1000**3

# Bytes per element of the dtypes a training step uses: the one table (Precision.param_bytes / compute_bytes,
# Finetune.adapter_bytes and the estimator read it).
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "tf32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "int8": 1,
    "uint8": 1,
    "fp8": 1,
    "int64": 8,
    "bool": 1,
}


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def gib(num_bytes: int | float) -> float:
    return num_bytes / GiB


def format_bytes(num_bytes: int | float, *, signed: bool = False) -> str:
    """Human size with binary units labelled as such (GiB, never 'GB' for 1024**3)."""
    sign = "+" if signed and num_bytes > 0 else ("-" if num_bytes < 0 else "")
    value = abs(num_bytes)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= size:
            return f"{sign}{value / size:.2f} {unit}"
    return f"{sign}{int(value)} B"


def parse_size(text: str) -> int:
    """'80GB' -> 80e9 bytes, '80GiB' / '80G' -> 80 * 2**30, '512MiB', '1.5TiB'. Bare numbers are GiB."""
    from .errors import ConfigError

    units = {
        "tib": 1024**4, "tb": 1000**4, "t": 1024**4,
        "gib": GiB, "gb": GB, "g": GiB,
        "mib": MiB, "mb": 1000**2, "m": MiB,
        "kib": KiB, "kb": 1000, "k": KiB, "b": 1,
    }
    cleaned = text.strip().lower().replace(" ", "")
    number, unit = cleaned, "gib"
    for suffix in sorted(units, key=len, reverse=True):
        if cleaned.endswith(suffix):
            number, unit = cleaned[: -len(suffix)], suffix
            break
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(f"cannot read size '{text}': use e.g. 80GiB, 80GB or 512MiB") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"size '{text}' must be a positive number of bytes")
    return int(value * units[unit])
