"""kvlm's C++ kernels (csrc/: products from GGUF blocks, and a layer's small ops): built once per machine with the system's C++ compiler, loaded with ctypes.

They are plain C++ without torch's headers, so a build takes about a second (a torch extension takes most of a
minute) and does not depend on torch's ABI; ctypes calls them with the tensors' data pointers. They are compiled for
the CPU they run on (`-march=native`: AVX-512 VNNI, AVX-512, AVX2 or plain C++, chosen by the compiler from what it
finds) and cached in $KVLM_HOME/kernels under a key of the sources, the compiler and the CPU's flags. OpenMP comes
from the libgomp torch has already loaded, so they share torch's threads.

Where no compiler is found, or the build fails, or KVLM_NATIVE=0, `load()` says so in one log line and returns
None: the caller then takes the pure-torch path (kvlm.kernels.reference) and keeps weights dense.

    python -m kvlm.kernels.native     # build now (the Makefile's install step does), print what was built
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from gguf.quants import IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS

from kvlm.home import kvlm_home
from kvlm.kernels.blocks import TILE_ROWS, BlockMatrix
from kvlm.kernels.dense import NativeDenseProduct, output_dtype
from kvlm.kernels.layer_ops import NativeLayerOps
from kvlm.kernels.recurrent import NativeRecurrentOps

log = logging.getLogger("kvlm")

SOURCES = Path(__file__).parent / "csrc"
SWITCH_VARIABLE = "KVLM_NATIVE"  # "0": never build or load the native kernels; else a gcc -march to build for
# -ffp-contract=off: no fused multiply-adds the source does not write, so vector and scalar code round alike;
# -fno-trapping-math: lets g++ vectorize exp_float's clamps and conversions (layer_ops.h); it changes no value.
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math")
_OK, _UNSUPPORTED_TYPE, _BAD_SHAPE = 0, 1, 2


class BuildError(RuntimeError):
    pass


def compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def build(march: str = "native") -> Path:
    """The shared library for `march` (gcc's -march: "native", or e.g. "x86-64-v3" for AVX2 alone), built if needed."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (g++, c++ or clang++ on the PATH, or $CXX)")
    target = kvlm_home() / "kernels" / _key(cxx, march) / "kvlm_kernels.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Another process may build the same library at the same time: each writes its own file, the last rename wins.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    command = [cxx, *FLAGS, f"-march={march}", "-o", partial, str(SOURCES / "kernels.cpp")]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        Path(partial).unlink(missing_ok=True)
        raise BuildError(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
    os.replace(partial, target)
    return target


def _key(cxx: str, march: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest.update(f"{version}\n{FLAGS}\n{march}\n{cpu_flags() if march == 'native' else ''}".encode())
    return digest.hexdigest()[:24]


def cpu_flags() -> str:
    """This CPU's feature flags: a library built for one CPU is never loaded on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


class NativeKernels:
    """The library's functions over torch tensors."""

    def __init__(self, path: Path) -> None:
        import torch  # noqa: F401  - first: the library must find torch's libgomp already loaded

        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.kvlm_isa.restype = ctypes.c_char_p
        self.isa: str = self._lib.kvlm_isa().decode()
        i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        self._lib.kvlm_dequantize.argtypes = [i32, ptr, i64, ptr, i64, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._lib.kvlm_matmul.argtypes = [ptr, ctypes.c_int, i64, i64, ctypes.c_int, ptr, ptr, ptr, ptr, ptr,
                                          ctypes.c_int, ctypes.c_int]
        self._lib.kvlm_interleave.argtypes = [i32, ptr, i64, i64, ctypes.c_int]
        self.tiles = bool(self._lib.kvlm_tiles())  # whether the products read interleaved tiles of 8 rows
        self._lib.kvlm_tiled.argtypes = [i32]
        self._lib.kvlm_tile_pass_rows.argtypes = [i32]
        self._lib.kvlm_set_tile_pass_rows.argtypes = [i32, ctypes.c_int]
        self.max_tile_pass_rows = int(self._lib.kvlm_max_tile_pass_rows())  # 0 without tiles
        self._lib.kvlm_set_grids.argtypes = [ptr, i64]
        self._lib.kvlm_grids_size.restype = i64
        self._set_grids()
        self.decode_layer_function = self._lib.kvlm_decode_layer
        self.decode_layer_function.argtypes = [ptr, ptr, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int64, ctypes.c_int]
        self.delta_layer_function = self._lib.kvlm_delta_layer
        self.delta_layer_function.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        self.layer_times_function = self._lib.kvlm_layer_times
        self.layer_times_function.argtypes = [ctypes.c_int, ptr]
        self.experts_function = self._lib.kvlm_experts
        self.experts_function.argtypes = [ptr, ptr, ctypes.c_int, i64, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int]
        self.layer_ops = NativeLayerOps(self._lib)
        self.recurrent = NativeRecurrentOps(self._lib)

    def _set_grids(self) -> None:
        """Hands gguf's grids of the I-quants to the library (csrc/low_bit_formats.h, Grids), before any use."""
        tables = []
        for quant in (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S):
            quant.init_grid()
            tables.append(quant.grid.reshape(-1).astype(np.int8))
        values = np.ascontiguousarray(np.concatenate(tables))
        if values.nbytes != self._lib.kvlm_grids_size():
            raise BuildError(f"the library's grids take {self._lib.kvlm_grids_size()} bytes, gguf's {values.nbytes}")
        self._lib.kvlm_set_grids(values.ctypes.data, values.nbytes)

    def tiled(self, qtype) -> bool:
        """Whether the products read matrices of this type in interleaved tiles of 8 rows."""
        return bool(self._lib.kvlm_tiled(int(qtype)))

    def tile_pass_rows(self, qtype) -> int:
        """Activation rows one pass over a tile of this type multiplies (0 where the type is not read in tiles)."""
        return int(self._lib.kvlm_tile_pass_rows(int(qtype)))

    def set_tile_pass_rows(self, qtype, rows: int) -> None:
        """Passes over tiles of this type multiply `rows` activation rows (1 to max_tile_pass_rows: 4, or 8 where
        AVX-512VL's 32 registers hold them; 0: this build's default). A row's bits do not depend on it;
        bench.tile_passes measures which is fastest. Not while products run."""
        status = self._lib.kvlm_set_tile_pass_rows(int(qtype), rows)
        if status == _UNSUPPORTED_TYPE:
            raise ValueError(f"{getattr(qtype, 'name', qtype)} is not read in tiles by these kernels")
        if status != _OK:
            raise ValueError(f"activation rows per pass must be 0 (the default) to {self.max_tile_pass_rows}, "
                             f"not {rows}")

    def interleave(self, matrix: BlockMatrix) -> BlockMatrix:
        """The matrix in the layout the products read fastest: its rows rearranged in tiles of 8 (kernels/csrc/tiles.h)
        in place, where this build reads this type's tiles and the rows fill whole tiles; otherwise as it is. The
        same bytes: `matrix` itself must not be used afterwards (its blocks now hold the tiles)."""
        if matrix.interleaved or not self.tiled(matrix.qtype) or matrix.shape[0] % TILE_ROWS:
            return matrix
        blocks = matrix.blocks if matrix.blocks.is_contiguous() else matrix.blocks.contiguous()
        status = self._lib.kvlm_interleave(int(matrix.qtype), blocks.data_ptr(), matrix.shape[0], matrix.n_cols,
                                           torch.get_num_threads())
        _check(status, [matrix])
        return BlockMatrix(blocks, matrix.qtype, matrix.n_cols, interleaved=True)

    def dequantize(self, matrix: BlockMatrix, dtype: torch.dtype = torch.float32, ids: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """gguf's values of the matrix (or of its rows `ids`), as float32 or rounded to bfloat16; into `out` if
        given (a buffer used again costs no page faults, which take longer than the dequantization itself)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the native dequantization writes float32 or bfloat16, not {dtype}")
        rows = matrix.shape[0] if ids is None else ids.numel()
        ids = None if ids is None else ids.to(torch.int64).contiguous()
        if out is None:
            out = torch.empty(rows, matrix.n_cols, dtype=dtype)
        elif out.dtype != dtype or out.shape != (rows, matrix.n_cols) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} [{rows}, {matrix.n_cols}], got {out.dtype} "
                             f"{list(out.shape)}")
        status = self._lib.kvlm_dequantize(int(matrix.qtype), matrix.blocks.data_ptr(), matrix.n_cols,
                                           None if ids is None else ids.data_ptr(), rows, out.data_ptr(),
                                           int(dtype == torch.bfloat16), torch.get_num_threads(),
                                           int(matrix.interleaved))
        _check(status, [matrix])
        return out

    def product(self, parts: list[BlockMatrix]) -> NativeProduct:
        return NativeProduct(self._lib, parts)

    def dense(self, weight: torch.Tensor) -> NativeDenseProduct:
        """x @ weight.T for float32, float16 or bfloat16 weights [out, in], each output row the same bits whatever
        the other rows of x (kvlm.kernels.dense)."""
        return NativeDenseProduct(self._lib, weight)


class NativeProduct:
    """x @ W.T for W the parts' rows stacked, each part in its own block format; its arguments prepared once."""

    def __init__(self, lib: ctypes.CDLL, parts: list[BlockMatrix]) -> None:
        if len({p.n_cols for p in parts}) != 1:
            raise ValueError(f"stacked parts need one width, got {[p.n_cols for p in parts]}")
        self._call = lib.kvlm_matmul
        self.parts = parts  # keeps the blocks alive while the pointers below are in use
        self.in_features = parts[0].n_cols
        self.out_features = sum(p.shape[0] for p in parts)
        self._types = (ctypes.c_int32 * len(parts))(*(int(p.qtype) for p in parts))
        self._weights = (ctypes.c_void_p * len(parts))(*(p.blocks.data_ptr() for p in parts))
        self._rows = (ctypes.c_int64 * len(parts))(*(p.shape[0] for p in parts))
        self._interleaved = (ctypes.c_int32 * len(parts))(*(int(p.interleaved) for p in parts))

    @property
    def c_arrays(self) -> tuple:
        """The parts' types, block pointers, row counts and layouts, as the C side's arrays."""
        return self._types, self._weights, self._rows, self._interleaved

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [m, in_features] float32 or bfloat16 -> [m, out_features] in `out_dtype` (float32 or bfloat16; None: x's
        dtype): float32 from bfloat16 activations is the sums as they are, before any rounding."""
        if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected float32 or bfloat16 [m, {self.in_features}], got {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=output_dtype(x, out_dtype))
        bf16, out_bf16 = int(x.dtype == torch.bfloat16), int(y.dtype == torch.bfloat16)
        status = self._call(x.data_ptr(), bf16, x.shape[0], self.in_features, len(self.parts), self._types,
                            self._weights, self._rows, self._interleaved, y.data_ptr(), out_bf16,
                            torch.get_num_threads())
        _check(status, self.parts)
        return y


def _check(status: int, parts: list[BlockMatrix]) -> None:
    if status == _UNSUPPORTED_TYPE:
        raise ValueError(f"the native kernels do not read {[p.qtype.name for p in parts]}")
    if status != _OK:
        raise ValueError(f"the native kernels cannot take these shapes: {[(p.qtype.name, p.shape) for p in parts]}")


@lru_cache(maxsize=None)
def load() -> NativeKernels | None:
    """The kernels built for this CPU (or for the -march KVLM_NATIVE names, e.g. x86-64-v3 for a machine image that
    must run on any AVX2 CPU), or None (said once in the log) where they cannot be had."""
    march = os.environ.get(SWITCH_VARIABLE, "native")
    if march == "0":
        log.info("native kernels off (%s=0): pure-torch products over dense weights", SWITCH_VARIABLE)
        return None
    started = time.perf_counter()
    try:
        kernels = NativeKernels(build(march))
    except (BuildError, OSError) as exc:
        log.warning("native kernels unavailable, using pure-torch products over dense weights: %s", exc)
        return None
    log.info("native kernels: %s (%s, ready in %.1f s)", kernels.isa, kernels.path, time.perf_counter() - started)
    return kernels


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = load()
    raise SystemExit(0 if built is not None else 1)
