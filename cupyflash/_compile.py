"""Compilation through NVRTC, cached in memory and on disk, and loading onto the GPU.

NVRTC runs without a GPU, so the same path serves the CPU compile checks (with ptxas reports)
and the GPU. The disk cache key is a hash of the full source text (headers inlined), the options
and the NVRTC version; set CUPYFLASH_CACHE_DIR to move it (default ~/.cache/cupyflash).
"""

import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import multiprocessing
import os
import pathlib
import re
import signal
import struct
import threading
import warnings
from typing import Optional

from ._arrays import SetupError, missing_nvrtc

# -default-device: every function is device code, which the kernels' generic lambdas need (NVRTC
# would otherwise take them for host functions).
_OPTIONS = ("-std=c++17", "-default-device", "--ptxas-options=-v")
_load_lock = threading.Lock()


def _nvrtc(source, name, options):
    """(cubin bytes, log) of one NVRTC compile; raises RuntimeError with the log on failure.

    Seen on this project's CPU machines: NVRTC's own dlopen of libnvrtc-builtins occasionally fails
    in a fresh process ("failed to open libnvrtc-builtins"), while a ctypes load of the same file
    succeeds; once loaded, NVRTC finds it. So on that error, load it and try again."""
    try:
        return _nvrtc_once(source, name, options)
    except RuntimeError as error:
        if "libnvrtc-builtins" not in str(error) or not _load_nvrtc_builtins():
            raise
    return _nvrtc_once(source, name, options)


def _load_nvrtc_builtins():
    """Loads libnvrtc-builtins from the folder of the libnvrtc this process uses; True if it did."""
    try:
        with open("/proc/self/maps") as maps:
            folders = {pathlib.Path(line.split()[-1]).parent for line in maps if "libnvrtc.so" in line}
    except OSError:
        return False
    loaded = False
    for folder in folders:
        for library in folder.glob("libnvrtc-builtins.so*"):
            ctypes.CDLL(str(library))
            loaded = True
    return loaded


def _nvrtc_once(source, name, options):
    from cupy.cuda import nvrtc
    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed on {name} ({' '.join(options)}):\n"
                               f"{nvrtc.getProgramLog(program)}") from error
        return whole_elf(nvrtc.getCUBIN(program)), nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def whole_elf(cubin):
    """The cubin padded with zeros to the size its ELF header gives. CuPy's getCUBIN drops the last
    byte (it strips a trailing NUL, as for PTX text): the driver loads the rest, but nvdisasm and
    cuobjdump refuse a file whose program headers end past it."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:  # (64-bit ELF only)
        return cubin
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + bytes(max(0, size - len(cubin)))


def cache_dir():
    default = pathlib.Path.home() / ".cache" / "cupyflash"
    return pathlib.Path(os.environ.get("CUPYFLASH_CACHE_DIR", default))


@functools.cache
def nvrtc_version():
    """NVRTC's (major, minor); the first thing a compile asks, so a missing CuPy or NVRTC library
    surfaces here as a SetupError whose message names the extra to install."""
    try:
        from cupy.cuda import nvrtc
        return nvrtc.getVersion()
    except Exception:
        hint = missing_nvrtc()
        if hint:
            raise SetupError(hint) from None
        raise


def _options(arch):
    return (*_OPTIONS, f"--gpu-architecture=sm_{arch}")


def compile_kernel(kernel, arch):
    """Compiles `kernel` (a _kernels.Kernel) to a cubin for sm_`arch`; returns (cubin path, ptxas log)."""
    source = kernel.source()
    options = _options(arch)
    key = hashlib.sha256("\0".join((source, *options, repr(nvrtc_version()))).encode()).hexdigest()[:24]
    cubin_path = cache_dir() / f"{kernel.name}.sm{arch}.{key}.cubin"
    log_path = cubin_path.with_suffix(".log")
    if cubin_path.exists() and log_path.exists():
        return cubin_path, log_path.read_text()

    cubin, log = _nvrtc(source, kernel.name, options)
    cubin_path.parent.mkdir(parents=True, exist_ok=True)
    # Write under a temporary name and rename, so concurrent processes never read half a file.
    for path, data in ((log_path, log.encode()), (cubin_path, cubin)):
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return cubin_path, log


def _compile_for_report(kernel, arch):
    cubin_path, log = compile_kernel(kernel, arch)
    return resource_report(cubin_path.read_bytes(), log)


def _ignore_sigint():
    """Workers leave Ctrl-C to the parent, which cancels what is queued and waits for the running
    compiles (a second or two), so no worker dies mid-write or leaves a semaphore behind."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def compile_all(jobs, workers=None, progress=None):
    """Compiles each (arch, kernel) of `jobs` in worker processes; returns [(arch, kernel, ResourceReport)]
    sorted by arch and name. `progress(done, total, label)` is called after each compile.

    Raises SetupError (a one-line hint) when CuPy or NVRTC is missing, before any worker starts; on
    any error or KeyboardInterrupt the queued compiles are cancelled and the workers shut down."""
    nvrtc_version()
    results = []
    context = multiprocessing.get_context("spawn")  # no inherited CUDA state
    pool = concurrent.futures.ProcessPoolExecutor(workers or min(os.cpu_count() or 1, 8), mp_context=context,
                                                  initializer=_ignore_sigint)
    try:
        futures = {pool.submit(_compile_for_report, kernel, arch): (arch, kernel) for arch, kernel in jobs}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            arch, kernel = futures[future]
            results.append((arch, kernel, future.result()))
            if progress:
                progress(done, len(jobs), f"sm_{arch} {kernel.name}")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return sorted(results, key=lambda r: (r[0], r[1].name))


@dataclasses.dataclass(frozen=True)
class ResourceReport:
    registers: int
    stack_frame: int            # bytes of local memory per thread; spills live there
    spill_stores: Optional[int]
    spill_loads: Optional[int]

    @property
    def spills(self):
        """Spill bytes, or None when unknown (no ptxas report and a nonzero stack frame)."""
        if self.spill_stores is None:
            return None
        return self.spill_stores + self.spill_loads

    @property
    def clean(self):
        """No spills and no stack frame: what every cupyflash kernel must compile to."""
        return self.spills == 0 and self.stack_frame == 0


def ptxas_report(log):
    """(registers, stack frame, spill stores, spill loads) from NVRTC's `--ptxas-options=-v` log,
    or None when the log holds no report (seen on the H200 machine under pytest-xdist: most kernels
    without spills came back with no ptxas lines; a lone compile there had them. Cause unknown)."""
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    if not (frame and regs):
        return None
    return int(regs.group(1)), int(frame.group(1)), int(frame.group(2)), int(frame.group(3))


def elf_sections(elf):
    """{name: (offset, size)} of the sections of an ELF64 file (a cubin)."""
    table, = struct.unpack_from("<Q", elf, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, table + i * entry_size) for i in range(count)]
    names = headers[names_index][4]
    return {elf[names + h[0]:elf.index(b"\0", names + h[0])].decode(): (h[4], h[5]) for h in headers}


def cubin_resources(cubin):
    """(registers, stack frame bytes) from the cubin's .nv.info section (EIATTR_REGCOUNT and
    EIATTR_FRAME_SIZE, the largest over its functions): the compiler's own record, whatever the log."""
    offset, size = elf_sections(cubin)[".nv.info"]
    values = {_REGCOUNT: [0], _FRAME_SIZE: [0]}
    position = offset
    while position < offset + size:
        form, attribute, length = struct.unpack_from("<BBH", cubin, position)
        if form == _EIFMT_SVAL:  # a sized value; these two hold (function symbol, value)
            if attribute in values:
                values[attribute].append(struct.unpack_from("<II", cubin, position + 4)[1])
            position += 4 + length
        else:
            position += 4
    return max(values[_REGCOUNT]), max(values[_FRAME_SIZE])


_EIFMT_SVAL, _FRAME_SIZE, _REGCOUNT = 0x04, 0x11, 0x2F


def resource_report(cubin, log):
    """Registers and stack frame from the cubin; spill bytes from the ptxas log when it has them,
    else 0 when there is no stack frame (spills need one) and unknown otherwise."""
    registers, stack_frame = cubin_resources(cubin)
    reported = ptxas_report(log)
    if reported is not None:
        return ResourceReport(registers, stack_frame, reported[2], reported[3])
    known_zero = 0 if stack_frame == 0 else None
    return ResourceReport(registers, stack_frame, known_zero, known_zero)


_loaded = {}


def spill_free(kernel, arch):
    """(the kernel that runs for `kernel`, its cubin path): `kernel` itself, or where its features
    compile with spills the same kernel with every feature. ptxas's allocation near the register
    limit is not monotone in the code, so a subset of the features can spill where the whole set
    does not; the compile checks keep every whole set clean, and its extra features stay off at run
    time (each tests its parameters: cuda_src/common/score.cuh). Where what runs still spills (an
    NVRTC other than the checks'), a warning says so."""
    cubin_path, log = compile_kernel(kernel, arch)
    report = resource_report(cubin_path.read_bytes(), log)
    whole = kernel.with_every_feature()
    if whole != kernel and not report.clean:
        kernel, (cubin_path, log) = whole, compile_kernel(whole, arch)
        report = resource_report(cubin_path.read_bytes(), log)
    if not report.clean:
        warn_unclean(kernel, arch, report)
    return kernel, cubin_path


def warn_unclean(kernel, arch, report):
    """A warning that this NVRTC's ptxas spilled registers in a kernel a call runs (correct, but
    slower): the compile checks hold every variant clean with NVRTC 13.0 (the README says which
    other versions do)."""
    what = (f"{report.spills} bytes of register spills" if report.spills
            else f"a {report.stack_frame}-byte stack frame")
    version = ".".join(map(str, nvrtc_version()))
    warnings.warn(f"cupyflash: NVRTC {version} compiled {kernel.name} for sm_{arch} with {what}: it runs "
                  f"correctly, but slower. NVRTC 13.0 (the cuda13 extra) compiles every cupyflash kernel "
                  f"without; on a CUDA 12 driver, pip install -U nvidia-cuda-nvrtc-cu12 (README: NVRTC's "
                  f"version).", RuntimeWarning)


def load(kernel, device):
    """A cupy.RawKernel for `kernel` on `device` (a cupy.cuda.Device), compiled on first use
    (spill_free's choice)."""
    key = (kernel, device.id)
    function = _loaded.get(key)
    if function is None:
        import cupy
        arch = kernel.arch(device.compute_capability)  # e.g. "90", "90a"
        with _load_lock:
            runs, cubin_path = spill_free(kernel, arch)
            with device:
                function = cupy.RawModule(path=str(cubin_path)).get_function(runs.name)
                if kernel.smem_bytes > 48 * 1024:
                    function.max_dynamic_shared_size_bytes = kernel.smem_bytes
            _loaded[key] = function
    return function


def cache_usage():
    """(number of files, bytes) in the kernel cache."""
    files = [p for p in cache_dir().glob("*") if p.is_file()] if cache_dir().is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)
