#!/usr/bin/env bash
# Register use of every CUDA kernel Strata builds: registers, local memory (the stack frame),
# spill stores and loads (the STL and LDL instructions in its machine code) and static shared
# memory, one line per kernel, for one architecture. A kernel with local-memory traffic is
# flagged SPILL: ptxas spilled registers to its stack frame, or it keeps an array there
# (indexed at run time, or a math library slow path such as the double-precision sincos's
# argument reduction); its STL/LDL lines (cuobjdump --dump-sass) say which.
#
# Usage: tools/cuda-register-use.sh [--arch SM] [--spills-only] [--sass] [--elf] BUILD_DIR|FILE...
#   BUILD_DIR: a build directory; its kernel objects (kernels/CMakeFiles/strata_kernels.dir/*.o,
#   so it works while the library is still being built) or else kernels/libstrata_kernels.a.
#   FILE: object files or static libraries holding CUDA fat binaries.
#   --arch SM: the architecture to report (e.g. 90); default: the highest in the files.
#   --spills-only: only the flagged kernels. --sass: then each flagged kernel's STL and LDL
#   instructions in context (needs cuobjdump). --elf: read the cubins without cuobjdump.
# Reads with cuobjdump (--dump-resource-usage, and --dump-sass for the STL/LDL counts) where it
# is on the PATH or beside nvcc; else with its own reader of the cubins' ELF sections
# (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE, .nv.shared.*, opcodes 0x387 STL and 0x983 LDL), which
# needs uncompressed cubins (nvcc's default). Needs python3; c++filt, when present, demangles.
set -euo pipefail

usage() { sed -n '9,15p' "$0" | sed 's/^# \{0,1\}//'; }

arch=""
spills_only=0
sass=0
force_elf=0
inputs=()
while (($#)); do
  case "$1" in
    --arch)
      arch=${2:-}
      if [[ ! "$arch" =~ ^[0-9]+[a-z]?$ ]]; then
        echo "cuda-register-use: --arch takes a number such as 90, not '${arch}'" >&2
        exit 2
      fi
      shift
      ;;
    --spills-only) spills_only=1 ;;
    --sass) sass=1 ;;
    --elf) force_elf=1 ;;
    -h | --help)
      usage
      exit 0
      ;;
    -*)
      echo "cuda-register-use: unknown option '$1'" >&2
      usage >&2
      exit 2
      ;;
    *) inputs+=("$1") ;;
  esac
  shift
done
if ((${#inputs[@]} == 0)); then
  usage >&2
  exit 2
fi

files=()
for input in "${inputs[@]}"; do
  if [[ -d "$input" ]]; then
    objects=()
    while IFS= read -r f; do objects+=("$f"); done < <(
      find "$input/kernels/CMakeFiles/strata_kernels.dir" -maxdepth 1 -name '*.cu.o' 2>/dev/null |
        LC_ALL=C sort)
    if ((${#objects[@]} > 0)); then
      files+=("${objects[@]}")
    elif [[ -f "$input/kernels/libstrata_kernels.a" ]]; then
      files+=("$input/kernels/libstrata_kernels.a")
    else
      echo "cuda-register-use: $input has no kernel objects" \
        "(kernels/CMakeFiles/strata_kernels.dir/*.cu.o) and no kernels/libstrata_kernels.a;" \
        "is it a CUDA build directory?" >&2
      exit 1
    fi
  elif [[ -f "$input" ]]; then
    files+=("$input")
  else
    echo "cuda-register-use: no such file or directory: $input" >&2
    exit 1
  fi
done

cuobjdump=""
if ((!force_elf)); then
  cuobjdump=$(command -v cuobjdump || true)
  if [[ -z "$cuobjdump" ]]; then
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    [[ -x "$(dirname "$nvcc")/cuobjdump" ]] && cuobjdump="$(dirname "$nvcc")/cuobjdump"
  fi
fi
if ((sass)) && [[ -z "$cuobjdump" ]]; then
  echo "cuda-register-use: --sass needs cuobjdump (on the PATH or beside nvcc)" >&2
  exit 2
fi
demangler=$(command -v c++filt || true)

python3 - "$arch" "$spills_only" "$sass" "$cuobjdump" "$demangler" "${files[@]}" <<'EOF'
import os
import re
import struct
import subprocess
import sys

want_arch, spills_only, sass = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
cuobjdump, demangler = sys.argv[4], sys.argv[5]
files = sys.argv[6:]


class Kernel:
    def __init__(self, arch, name, where):
        self.arch, self.name, self.where = arch, name, where
        self.regs = self.frame = self.shared = self.stl = self.ldl = 0
        self.code = []  # its SASS lines (cuobjdump only)


# ---- with cuobjdump


def run(args):
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit("cuda-register-use: %s failed: %s" % (" ".join(args), r.stderr.strip()[:400]))
    return r.stdout


def with_cuobjdump(path):
    kernels = {}
    arch = None
    current = None
    for line in run([cuobjdump, "--dump-resource-usage", path]).splitlines():
        m = re.match(r"\s*arch = sm_(\w+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            current = Kernel(arch, m.group(1), os.path.basename(path))
            kernels[(arch, current.name)] = current
            continue
        if current is not None and "REG:" in line:
            fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line))
            current.regs = int(fields.get("REG", 0))
            current.shared = int(fields.get("SHARED", 0))
            current.frame = max(int(fields.get("STACK", 0)), int(fields.get("LOCAL", 0)))
            current = None
    arch = None
    current = None
    for line in run([cuobjdump, "--dump-sass", path]).splitlines():
        m = re.match(r"\s*arch = sm_(\w+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = kernels.get((arch, m.group(1)))
            continue
        if current is not None and re.search(r"/\*[0-9a-f]{4,}\*/", line):  # an instruction
            current.code.append(re.sub(r"\s*/\* 0x[0-9a-f]+ \*/", "", line).strip())
            if re.search(r"\bSTL(\.\w+)*\s", line):
                current.stl += 1
            elif re.search(r"\bLDL(\.\w+)*\s", line):
                current.ldl += 1
    return list(kernels.values())


# ---- without: the cubins' ELF sections

EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x11, 0x2F
OP_STL, OP_LDL = 0x387, 0x983  # the low 12 bits of a Volta-or-later instruction


def elf_sections(data):
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
               for i in range(shnum)]
    names = headers[shstrndx]
    out = []
    for h in headers:
        name = data[names[4] + h[0]:].split(b"\0", 1)[0].decode()
        out.append((name, h, data[h[4]:h[4] + h[5]] if h[1] != 8 else b""))  # 8: NOBITS
    return out


def archive_members(data, path):
    if not data.startswith(b"!<arch>\n"):
        yield os.path.basename(path), data
        return
    pos, longnames = 8, b""
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip()
        size = int(header[48:58].decode().strip())
        body = data[pos + 60:pos + 60 + size]
        if name == "//":
            longnames = body
        elif name.startswith("/") and name[1:].isdigit():
            start = int(name[1:])
            yield longnames[start:].split(b"/\n", 1)[0].decode(), body
        elif name not in ("/", "/SYM64/"):
            yield name.rstrip("/"), body
        pos += 60 + size + (size & 1)


def cubins(obj):
    sections = elf_sections(obj)
    if sections is None:
        return
    for name, _, fatbin in sections:
        if name != ".nv_fatbin":
            continue
        off = 0
        while off + 16 <= len(fatbin):
            magic, _, header_size, body_size = struct.unpack_from("<IHHQ", fatbin, off)
            if magic != 0xBA55ED50:
                break
            p, end = off + header_size, off + header_size + body_size
            while p + 32 <= end:
                kind, _, entry_header, payload = struct.unpack_from("<HHIQ", fatbin, p)
                sm = struct.unpack_from("<I", fatbin, p + 28)[0]
                if kind == 2:  # ELF (1 is PTX)
                    yield str(sm), fatbin[p + entry_header:p + entry_header + payload]
                p += entry_header + payload
            off = end


def info_records(data):
    p = 0
    while p + 4 <= len(data):
        fmt, attr = data[p], data[p + 1]
        if fmt == 4:  # EIFMT_SVAL: a 16-bit size, then that many bytes
            size = struct.unpack_from("<H", data, p + 2)[0]
            yield attr, data[p + 4:p + 4 + size]
            p += 4 + size
        elif fmt in (1, 2, 3):  # no value, a byte, a half-word: four bytes in all
            p += 4
        else:
            return


def from_cubin(arch, cubin, where):
    sections = elf_sections(cubin)
    if sections is None:
        sys.exit("cuda-register-use: a sm_%s cubin in %s is not plain ELF (compressed?); "
                 "read it with cuobjdump" % (arch, where))
    symtab = next(h for name, h, _ in sections if name == ".symtab")
    strtab = sections[symtab[6]][2]
    symbols = []
    table = cubin[symtab[4]:symtab[4] + symtab[5]]
    for i in range(len(table) // 24):
        offset = struct.unpack_from("<I", table, i * 24)[0]
        symbols.append(strtab[offset:].split(b"\0", 1)[0].decode())
    regs, frame = {}, {}
    for name, _, body in sections:
        if name != ".nv.info":
            continue
        for attr, value in info_records(body):
            if len(value) == 8 and attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE):
                index, number = struct.unpack("<II", value)
                (regs if attr == EIATTR_REGCOUNT else frame)[symbols[index]] = number
    kernels = {}
    for name in regs:  # entry functions: the ones with a register count of their own
        k = Kernel(arch, name, where)
        k.regs, k.frame = regs[name], frame.get(name, 0)
        kernels[name] = k
    for name, header, body in sections:
        if name.startswith(".text.") and name[6:] in kernels:
            k = kernels[name[6:]]
            for i in range(0, len(body) - 15, 16):
                op = struct.unpack_from("<Q", body, i)[0] & 0xFFF
                k.stl += op == OP_STL
                k.ldl += op == OP_LDL
        elif name.startswith(".nv.shared.") and name[11:] in kernels:
            kernels[name[11:]].shared = header[5]
    return list(kernels.values())


def with_elf_reader(path):
    data = open(path, "rb").read()
    found = []
    for member, obj in archive_members(data, path):
        for arch, cubin in cubins(obj):
            found += from_cubin(arch, cubin, member)
    return found


kernels = []
for path in files:
    kernels += with_cuobjdump(path) if cuobjdump else with_elf_reader(path)
if not kernels:
    sys.exit("cuda-register-use: no CUDA kernels in " + " ".join(files))
archs = sorted({k.arch for k in kernels}, key=lambda a: int(re.sub(r"\D", "", a) or 0))
arch = want_arch or archs[-1]
kernels = [k for k in kernels if k.arch == arch]
if not kernels:
    sys.exit("cuda-register-use: no sm_%s code in the files (they have sm_%s)" %
             (arch, ", sm_".join(archs)))

names = [k.name for k in kernels]
if demangler:
    out = subprocess.run([demangler], input="\n".join(names), stdout=subprocess.PIPE,
                         text=True).stdout
    if len(out.splitlines()) == len(names):
        names = out.splitlines()


def short(name):  # void strata::kernels::(anonymous namespace)::k<float>(...) -> k<float>
    name = re.sub(r"^void |strata::kernels::|\(anonymous namespace\)::|strata::", "", name)
    depth = 0
    for i, c in enumerate(name):  # drop the parameter list: the first '(' outside template brackets
        depth += {"<": 1, ">": -1}.get(c, 0)
        if c == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


rows = sorted(zip(kernels, (short(n) for n in names)), key=lambda r: (r[0].where, r[1]))
flagged = [r for r in rows if r[0].stl + r[0].ldl > 0 or r[0].frame > 0]
print("sm_%s, %d kernels (%s), %d with local memory" %
      (arch, len(rows), "cuobjdump" if cuobjdump else "ELF reader", len(flagged)))
print("%5s %6s %4s %4s %7s  %-5s %-29s %s" %
      ("regs", "frame", "stl", "ldl", "smem", "flag", "file", "kernel"))
for k, name in flagged if spills_only else rows:
    flag = "SPILL" if k.stl + k.ldl > 0 or k.frame > 0 else ""
    print("%5d %6d %4d %4d %7d  %-5s %-29s %s" %
          (k.regs, k.frame, k.stl, k.ldl, k.shared, flag, k.where.replace(".cu.o", ".cu"), name))
if sass:
    for k, name in flagged:
        print("\n%s (%s), %d instructions; its STL and LDL with three lines either side:" %
              (name, k.where, len(k.code)))
        local = [i for i, line in enumerate(k.code) if re.search(r"\b(STL|LDL)(\.\w+)*\s", line)]
        shown = sorted({j for i in local for j in range(max(0, i - 3), min(len(k.code), i + 4))})
        for n, j in enumerate(shown):
            if n > 0 and j != shown[n - 1] + 1:
                print("    ...")
            print(("  > " if j in local else "    ") + k.code[j])
EOF
