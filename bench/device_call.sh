# Sourced from the repository root by a device call's script (bench/notes/*-next-call*.sh, run as
# .device_scratch/next_callN.sh): the carried kernel cache unpacked and used, S the carried trees,
# L the call's log (in $OUT). save_new_kernels packs what the call compiled into $OUT, to unpack
# into .device_cache/ here (bench/DEVICE.md).
mkdir -p /tmp/pcache && tar -xJf .device_scratch/cache.tar.xz -C /tmp/pcache --strip-components=1
export CUPYFLASH_CACHE_DIR=/tmp/pcache XLA_PYTHON_CLIENT_PREALLOCATE=false
touch /tmp/t0
cp bench/ab.py /tmp/
S=$PWD/.device_scratch
L=$OUT/log.txt
save_new_kernels() { find /tmp/pcache -newer /tmp/t0 -type f | tar -cJf "$OUT/newcache.tar.xz" -T - 2>/dev/null; }
