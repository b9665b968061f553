"""The kernels' shared library: this package's C files (one a family of kernels, and ``common.h``, the header they
share) compiled together by the system's C compiler, cached, and loaded with the ctypes signature of every function it
exports.

The library is cached under ``$LIGHTNING_GRAVAC_CACHE`` (default ``~/.cache/lightning_gravac``), keyed by every C file's
name and text, the header's included (a change in any one builds it again), the flags, the compiler and the CPU (it is
built for the CPU it runs on).
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

#: The folder of the C files and of the header they share.
_SOURCES = Path(__file__).parent
# No contraction of a * b + c into a fused multiply-add (explicit fmaf only): the kernels give the eager path's bits,
# whichever compiler `cc` is.
_FLAGS = ("-O3", "-march=native", "-fno-strict-aliasing", "-ffp-contract=off", "-std=c11", "-shared", "-fPIC")

# The C types of the kernels' arguments and results. Every pointer is passed as an address (a tensor's data_ptr(), or
# None for NULL), but for the double out-parameters that ctypes fills in.
_ADDRESS, _INT, _I64, _U64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
_F32, _F64, _F64_OUT = ctypes.c_float, ctypes.c_double, ctypes.POINTER(ctypes.c_double)

#: Every function the library exports: its argument types and its result type (None: void), set as it loads.
SIGNATURES: dict[str, tuple[tuple[type, ...], type | None]] = {
    # sparse.c
    "lg_block_peaks": ((_ADDRESS, _I64, _ADDRESS, _INT, _INT), None),
    "lg_block_extremes": ((_ADDRESS, _I64, _ADDRESS, _ADDRESS, _INT), None),
    "lg_scan": ((_ADDRESS, _I64, _ADDRESS, _F32, _INT, _ADDRESS, _INT), _I64),
    "lg_scatter_add": ((_ADDRESS, _I64, _ADDRESS, _I64, _ADDRESS, _F32, _F32), _INT),
    # feedback.c
    "lg_add_sq": ((_ADDRESS, _ADDRESS, _ADDRESS, _I64, _ADDRESS, _INT), _F64),
    "lg_accumulate": ((_ADDRESS, _F32, _ADDRESS, _F32, _ADDRESS, _ADDRESS, _ADDRESS, _I64, _ADDRESS, _INT), _F64),
    # signs.c
    "lg_pack_signs": ((_ADDRESS, _I64, _ADDRESS, _INT), None),
    "lg_add_signs": ((_ADDRESS, _I64, _F32, _F32, _ADDRESS, _INT), None),
    "lg_vote": ((_ADDRESS, _I64, _INT, _I64, _F32, _ADDRESS, _INT), None),
    # quantize.c
    "lg_uniforms": ((_U64, _I64, _ADDRESS, _INT), None),
    "lg_qsgd_encode": ((_ADDRESS, _I64, _ADDRESS, _I64, _INT, _INT, _U64, _ADDRESS, _INT), None),
    "lg_block_encode": ((_ADDRESS, _I64, _ADDRESS, _I64, _INT, _INT, _ADDRESS, _ADDRESS, _INT), None),
    "lg_block_absmax": ((_ADDRESS, _I64, _I64, _ADDRESS, _INT), None),
    "lg_moments": ((_ADDRESS, _I64, _ADDRESS, _F64_OUT, _INT), None),
    "lg_terngrad_encode": ((_ADDRESS, _I64, _F32, _F32, _U64, _ADDRESS, _INT), None),
    "lg_codes_add": ((_ADDRESS, _I64, _INT, _INT, _ADDRESS, _I64, _F32, _ADDRESS, _INT), None),
    "lg_codes_sq": ((_ADDRESS, _I64, _INT, _INT, _I64, _ADDRESS, _INT), None),
    # onebit.c
    "lg_onebit_sums": ((_ADDRESS, _I64, _I64, _ADDRESS, _ADDRESS, _INT), None),
    "lg_onebit_add": ((_ADDRESS, _I64, _I64, _ADDRESS, _ADDRESS, _ADDRESS, _INT), None),
    # casts.c
    "lg_half_sq": ((_ADDRESS, _I64, _INT, _ADDRESS, _INT), _F64),
    "lg_half_bits": ((_ADDRESS, _I64, _INT, _ADDRESS), None),
    "lg_cast_half": ((_ADDRESS, _I64, _INT, _ADDRESS, _ADDRESS, _F64_OUT, _INT), _F64),
    # natural.c
    "lg_natural_top": ((_ADDRESS, _I64, _U64, _INT, _INT), _INT),
    "lg_natural_encode": ((_ADDRESS, _I64, _U64, _INT, _INT, _INT, _ADDRESS, _ADDRESS, _INT), _F64),
    "lg_natural_add": ((_ADDRESS, _I64, _ADDRESS, _ADDRESS, _INT), None),
    # lowrank.c
    "lg_skinny_available": ((), _INT),
    "lg_skinny_mq": ((_ADDRESS, _I64, _I64, _ADDRESS, _I64, _ADDRESS, _INT), _INT),
    "lg_skinny_mtp": ((_ADDRESS, _I64, _I64, _ADDRESS, _I64, _ADDRESS, _ADDRESS, _INT), _INT),
    "lg_skinny_add_pqt": ((_ADDRESS, _I64, _I64, _ADDRESS, _ADDRESS, _I64, _F32, _F32, _INT), _INT),
}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library with its signatures set (built or found in the cache on the first call), or None where the kernels
    are turned off or do not build (the reason logged once)."""
    if os.environ.get("LIGHTNING_GRAVAC_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as error:
        log.info("lightning_gravac: compiled selection kernels unavailable (%s); using eager PyTorch", error)
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def _build() -> Path:
    """The shared library for these sources, compiler and CPU, compiled unless cached. Ranks starting together may
    each compile it; each writes its own temporary file and renames it into place, so none loads a partial one."""
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    files = sorted(_SOURCES.glob("*.c"))
    # Every file's name and text: a change in any one, the header included, builds the library again.
    source = b"\0".join(path.name.encode() + b"\0" + path.read_bytes() for path in sorted(_SOURCES.glob("*.[ch]")))
    failure = ""
    for openmp in (("-fopenmp",), ()):  # without OpenMP the kernels run on one thread
        flags = (*_FLAGS, *openmp)
        key = hashlib.sha256(b"\0".join([source, " ".join([*compiler, *flags]).encode(), _cpu()])).hexdigest()[:16]
        cache = Path(os.environ.get("LIGHTNING_GRAVAC_CACHE") or Path.home() / ".cache" / "lightning_gravac")
        target = cache / f"kernels-{key}.so"
        if target.exists():
            return target
        cache.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=cache, suffix=".so")
        os.close(fd)
        try:
            command = [*compiler, *flags, *map(str, files), "-o", partial]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            os.replace(partial, target)
            return target
        except subprocess.CalledProcessError as error:
            failure = error.stderr.decode(errors="replace")[-500:]
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    raise subprocess.SubprocessError(f"{' '.join(compiler)} failed: {failure}")


def _cpu() -> bytes:
    """What ``-march=native`` depends on: the architecture and, on Linux, the CPU's model and feature flags."""
    fields = {"machine": platform.machine()}
    try:
        with open("/proc/cpuinfo") as info:  # the first CPU's lines; every core of a machine has the same
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "flags"):
                    fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return repr(sorted(fields.items())).encode()
