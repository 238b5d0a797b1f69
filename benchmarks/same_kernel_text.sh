#!/usr/bin/env bash
# Checks, on the CPU machine (no GPU, no disassembler needed), that a change leaves kernels' machine
# code as it was: compiles each named instance from <old_rev> and from the working tree to a cubin
# with the build's own nvcc flags, and compares the cubins section by section. Only .strtab may
# differ: its internal-linkage names carry a hash of the source's path. A refactor that passes
# needs no device time to show it changed nothing; one that fails changed code, and needs the GPU.
#
# To run (from the repo root; about a minute per instance and tree, two at a time):
#   bash benchmarks/same_kernel_text.sh <old_rev> [instance ...]
#   instance: a generated .cu's base name (build/.../generated/*.cu), default the bf16 (E, K, N)
#   cooperative forward and both bf16 wgrad instances. The builds configure a reduced sm90 set
#   (bf16, (E, K, N)) in /tmp/same_text_{old,new}; exit 0 when every instance matches, 1 otherwise.
set -uo pipefail
if [ $# -lt 1 ]; then sed -n 2,12p "$0"; exit 2; fi
rev=$1; shift
instances=("$@")
if [ ${#instances[@]} -eq 0 ]; then
  instances=(sm90_moe_kbfloat16_kkn_ksm90cooperative_128x256x64_1x1x1
             sm90_wgrad_moe_kbfloat16_kbfloat16_ksm90cooperative_128x256x64_1x1x1
             sm90_wgrad_moe_kbfloat16_kfloat32_ksm90cooperative_128x256x64_1x1x1)
fi
src=$(git rev-parse --show-toplevel) || exit 2
old_src=/tmp/same_text_old_src
rm -rf "$old_src" && mkdir -p "$old_src"
git -C "$src" archive "$rev" | tar -x -C "$old_src" || exit 2
configure() {  # configure TREE BUILD_DIR (anew: a folder configured from another tree is refused)
  rm -rf "$2"
  cmake -S "$1" -B "$2" -G Ninja -DCUTLASS_MOE_BUILD_PYTHON=OFF -DCUTLASS_MOE_ARCHS=90a \
    -DCUTLASS_MOE_DTYPES=kBFloat16 -DCUTLASS_MOE_WEIGHT_LAYOUTS=kKN -DCUTLASS_MOE_SM80_CONFIGS= >"$2.cmake.log" 2>&1 ||
    { tail -20 "$2.cmake.log"; exit 1; }
}
cubin() {  # cubin BUILD_DIR INSTANCE OUT: the instance's own compile command, to a cubin
  local cmd
  cmd=$(cd "$1" && ninja -t commands "CMakeFiles/cutlass_moe.dir/generated/$2.cu.o" | tail -1)
  [ -n "$cmd" ] || { echo "no instance $2 in $1"; return 1; }
  cmd=$(echo "$cmd" | sed -e 's/ -c / -cubin /' -e "s# -o [^ ]*\.o# -o $3#" -e 's/-MD -MT [^ ]* -MF [^ ]*//')
  (cd "$1" && eval "$cmd") >"$3.log" 2>&1 || { tail -20 "$3.log"; return 1; }
}
configure "$old_src" /tmp/same_text_old
configure "$src" /tmp/same_text_new
status=0
for instance in "${instances[@]}"; do
  cubin /tmp/same_text_old "$instance" "/tmp/same_text_old/$instance.cubin" & pid=$!
  cubin /tmp/same_text_new "$instance" "/tmp/same_text_new/$instance.cubin" || status=1
  wait $pid || status=1
  python3 - "/tmp/same_text_old/$instance.cubin" "/tmp/same_text_new/$instance.cubin" "$instance" <<'PY' || status=1
import struct, sys

def sections(path):  # name -> bytes of each section of an ELF64 file
    b = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", b, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", b, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * entsize) for i in range(count)]
    names = b[headers[names_index][4]:][:headers[names_index][5]]
    return {names[h[0]:names.index(b"\0", h[0])].decode(): b"" if h[1] == 8 else b[h[4]:h[4] + h[5]]
            for h in headers}

old, new = sections(sys.argv[1]), sections(sys.argv[2])
differ = [n for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n) and n != ".strtab"]
text = sum(len(v) for n, v in old.items() if n.startswith(".text."))
print(f"{sys.argv[3]}: {'SAME' if not differ else 'DIFFERENT'} ({text} bytes of kernel text)"
      + "".join(f"\n  differs: {n[:100]}" for n in differ))
sys.exit(1 if differ else 0)
PY
done
exit $status
