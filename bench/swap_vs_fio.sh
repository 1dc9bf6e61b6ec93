#!/usr/bin/env bash
# Strata's swap engine against fio at its best on the same file system: sequential O_DIRECT read
# and write at 128 KiB, 1 MiB and 8 MiB blocks, queue depth 8 and 32, in alternating strata/fio
# pairs; prints every pair, the median ratio strata/fio per case (targets: at least 0.95, and at
# least 1.0 at 1 MiB, the default swap_block_size) and each tool's CPU time per GB moved.
#
# Usage: bench/swap_vs_fio.sh [STRATA_BINARY]
#   DIR=/path/on/the/drive   directory to test (default /tmp/strata-swap-vs-fio; not tmpfs)
#   SIZE_MIB=2048            bytes per run, in MiB (both tools)
#   PAIRS=5                  strata/fio pairs per case
#   THREADS=1                strata --threads = fio numjobs (each job a 1/THREADS slice)
#   BLOCKS="128k 1m 8m" DEPTHS="8 32" OPS="read write"   the cases (fio's size suffixes)
#   FIO_IOMEM=shmhuge        fio's buffers: shmhuge (huge pages, reserved here and released at
#                            exit; needs root), or malloc (4 KiB pages) for a control run
#   STRATA_FLAGS=...         extra io-bench flags, e.g. "--no-huge-pages" for a control run
#   FIO_HISTORY=both         fio's file: new for every pair, as io-bench's swap file is (new);
#                            one file kept for the whole run and rewritten by every pair (aged);
#                            or both, each pair timing fio on each (both): a file's history moves
#                            its speed by more than the targets' margin on some devices, and which
#                            history is faster differs from device to device
#   RAM_DEVICE_GIB=N         measure on a RAM-backed block device of N GiB instead of DIR's drive:
#                            a loop device with direct I/O over a file in /dev/shm, formatted
#                            ext4 and mounted for the run, then removed (needs root, losetup and
#                            mkfs.ext4). Its speed does not drift with the disk's history or its
#                            neighbours, so it shows the engines' own cost; its copies run on
#                            this machine's CPUs (the loop worker), beside both tools.
#
# What makes the two comparable: both use io_uring with O_DIRECT on the same directory, the same
# bytes, block size, queue depth and job count, sequential offsets from 0, and buffers in 2 MiB
# huge pages (one DMA segment per request, not 256: without them fio loses up to half its
# bandwidth at 1 MiB on a fast device, which is not the engine's doing). Each timed run follows
# untimed passes by the same tool: a write of the whole file (twice before timed reads) and a
# read (strata io-bench verifies its data that way before timing; fio does the same passes here),
# so both read data written moments before and both write over blocks that were already written.
# io-bench's file is new for every run. fio is timed on a new file too, and on one file that
# lives for the whole run: a file's history has moved fio's speed both ways (a long-lived file
# wrote at half speed on a VM's virtio disk, faster on a RAM-backed loop device), so each case
# is judged against the history on which fio was faster, fio at its best. Both read back random
# data that differs from block to block (strata io-bench always writes such data; fio's untimed
# write uses --refill_buffers): a virtual disk may read a file made of one repeated buffer at
# another speed. fio's timed writes keep its default repeated buffer, its fastest setting
# (--refill_buffers costs it CPU). That buffer set is depth x block bytes, 8 MiB at 1 MiB depth 8,
# and stays in the CPU's last-level cache, while io-bench writes block-unique data from a 1 GiB
# source in memory: on a device that copies with the CPU (RAM_DEVICE_GIB) this favours fio's
# small-set writes by about 14% (bench/RESULTS.md); a drive's DMA does not care. The disk
# varies +-20% from run to run, so the runs of a pair rotate (who goes first moves each pair)
# and the ratio reported is the median of the pairs.
set -euo pipefail

STRATA=${1:-${STRATA:-build/strata}}
DIR=${DIR:-/tmp/strata-swap-vs-fio}
SIZE_MIB=${SIZE_MIB:-2048}
PAIRS=${PAIRS:-5}
THREADS=${THREADS:-1}
BLOCKS=${BLOCKS:-"128k 1m 8m"}
DEPTHS=${DEPTHS:-"8 32"}
OPS=${OPS:-"read write"}
FIO_IOMEM=${FIO_IOMEM:-shmhuge}
STRATA_FLAGS=${STRATA_FLAGS:-}
RAM_DEVICE_GIB=${RAM_DEVICE_GIB:-}
FIO_HISTORY=${FIO_HISTORY:-both}
case $FIO_HISTORY in
  new | aged) HISTORIES=("$FIO_HISTORY") ;;
  both) HISTORIES=(new aged) ;;
  *) echo "FIO_HISTORY must be new, aged or both, got '$FIO_HISTORY'" >&2; exit 2 ;;
esac

command -v fio >/dev/null || { echo "fio is not installed (apt-get install fio)" >&2; exit 2; }
[[ -x "$STRATA" ]] || { echo "no strata binary at $STRATA (build it, or pass its path)" >&2; exit 2; }

# The RAM-backed device, when asked for; torn down by restore() at exit.
RAM_IMAGE= RAM_LOOP= RAM_MOUNT=
teardown_ram_device() {
  if [[ -n "$RAM_MOUNT" ]]; then umount "$RAM_MOUNT" 2>/dev/null || true; rmdir "$RAM_MOUNT"; fi
  if [[ -n "$RAM_LOOP" ]]; then losetup -d "$RAM_LOOP" 2>/dev/null || true; fi
  if [[ -n "$RAM_IMAGE" ]]; then rm -f "$RAM_IMAGE"; fi
}
if [[ -n "$RAM_DEVICE_GIB" ]]; then
  if ! [[ "$RAM_DEVICE_GIB" =~ ^[1-9][0-9]*$ ]]; then
    echo "RAM_DEVICE_GIB must be a whole number of GiB, got '$RAM_DEVICE_GIB'" >&2
    exit 2
  fi
  files=$(( 1 + ${#HISTORIES[@]} ))  # strata's, and one fio file per history
  if (( RAM_DEVICE_GIB * 1024 < SIZE_MIB * files )); then
    echo "RAM_DEVICE_GIB=$RAM_DEVICE_GIB cannot hold the run's $files files of ${SIZE_MIB} MiB" \
      "(needs at least $(( (SIZE_MIB * files + 1023) / 1024 + 1 )) GiB)" >&2
    exit 2
  fi
  for tool in losetup mkfs.ext4 mount; do
    command -v "$tool" >/dev/null || { echo "RAM_DEVICE_GIB needs $tool" >&2; exit 2; }
  done
  trap teardown_ram_device EXIT
  RAM_IMAGE=$(mktemp /dev/shm/strata-swap-vs-fio.XXXXXX)
  truncate -s "${RAM_DEVICE_GIB}G" "$RAM_IMAGE"
  RAM_LOOP=$(losetup --find --show --direct-io=on "$RAM_IMAGE") ||
    { echo "losetup could not attach $RAM_IMAGE (root needed)" >&2; exit 2; }
  mkfs.ext4 -q "$RAM_LOOP"
  RAM_MOUNT=$(mktemp -d /tmp/strata-ram-device.XXXXXX)
  mount "$RAM_LOOP" "$RAM_MOUNT"
  DIR="$RAM_MOUNT/swap"
fi
mkdir -p "$DIR"
if [[ "$(stat -f -c %T "$DIR")" == "tmpfs" ]]; then
  echo "$DIR is on tmpfs: pick a directory on the drive to measure (DIR=...)" >&2
  exit 2
fi
if (( SIZE_MIB % THREADS != 0 )); then
  echo "SIZE_MIB ($SIZE_MIB) must be a multiple of THREADS ($THREADS)" >&2
  exit 2
fi
if pgrep -x cc1plus >/dev/null; then
  echo "warning: a compiler is running; the figures will be noisy" >&2
fi

# Debian's python3 where there is one: a python3 earlier on PATH (a pyenv shim) takes 0.3 s to
# start, and the script runs it for every pair's ratio (the tests' runs took 51 s instead of 9).
py=/usr/bin/python3
[[ -x $py ]] || py=python3

# fio's file for each history: "new" is removed before every pair, "aged" lives for the run.
fio_file() { echo "$DIR/fio-bench-$1.dat"; }
JOB_MIB=$(( SIZE_MIB / THREADS ))

# Bytes of a fio size ("128k", "1m", "8m").
to_bytes() {
  local v=${1%[kKmM]}
  case "$1" in
    *[kK]) echo $((v * 1024)) ;;
    *[mM]) echo $((v * 1024 * 1024)) ;;
    *) echo "$1" ;;
  esac
}

# fio's huge-page buffers: enough 2 MiB pages for the largest case's buffers (block x depth per
# job, and fio's alignment slack), reserved now and given back at exit.
HUGE_FILE=/proc/sys/vm/nr_hugepages
HUGE_BEFORE=$(cat "$HUGE_FILE" 2>/dev/null || echo 0)
restore() {
  rm -f "$(fio_file new)" "$(fio_file aged)"
  if [[ "$FIO_IOMEM" == shmhuge && -w "$HUGE_FILE" ]]; then echo "$HUGE_BEFORE" >"$HUGE_FILE"; fi
  teardown_ram_device
}
trap restore EXIT
max_bs=0
for bs in $BLOCKS; do (( $(to_bytes "$bs") > max_bs )) && max_bs=$(to_bytes "$bs"); done
max_qd=0
for qd in $DEPTHS; do (( qd > max_qd )) && max_qd=$qd; done
FIO_BUFFERS="4 KiB pages (--iomem=$FIO_IOMEM)"
if [[ "$FIO_IOMEM" == shmhuge ]]; then
  need=$(( (max_bs * max_qd / (2 * 1024 * 1024) + 4) * THREADS + HUGE_BEFORE ))
  if ! { [[ -w "$HUGE_FILE" ]] && echo "$need" >"$HUGE_FILE" &&
    (( $(cat "$HUGE_FILE") >= need )); }; then
    echo "cannot reserve $need huge pages in $HUGE_FILE (root, and free memory, needed);" \
      "FIO_IOMEM=malloc runs fio with 4 KiB-page buffers instead" >&2
    exit 2
  fi
  FIO_BUFFERS="2 MiB huge pages (--iomem=shmhuge, $need pages reserved, $HUGE_BEFORE before)"
fi

# fio with THREADS jobs, each over its own slice of one file. Prints "MB/s CPU-s-per-GB" (MB =
# 1e6 bytes; CPU = usr + sys over the jobs' run time, as fio reports them).
fio_run() {  # history op block depth [extra fio options]
  local file op=$2 bs=$3 qd=$4 key
  file=$(fio_file "$1")
  shift 4
  key=$([[ $op == read ]] && echo read || echo write)
  fio --name=swap --filename="$file" --ioengine=io_uring --direct=1 --rw="$op" \
      --bs="$bs" --iodepth="$qd" --numjobs="$THREADS" --size="${JOB_MIB}m" \
      --offset_increment="${JOB_MIB}m" --iomem="$FIO_IOMEM" --group_reporting \
      --output-format=json "$@" |
    "$py" -c "
import json, sys
j = json.load(sys.stdin)['jobs'][0]
d = j['$key']
cpu_s = (j['usr_cpu'] + j['sys_cpu']) / 100.0 * j['job_runtime'] / 1e3
print('%.1f %.4f' % (d['bw_bytes'] / 1e6, cpu_s / (d['io_bytes'] / 1e9)))"
}

# The untimed passes strata io-bench makes before timing: write everything (random data that
# differs from block to block), again before timed reads, and read it back. With the "new"
# history the file is made anew first, as io-bench's is; the "aged" file has been through every
# earlier pair's passes too.
fio_prepare() {  # history op block depth
  [[ $1 == new ]] && rm -f "$(fio_file new)"
  fio_run "$1" write "$3" "$4" --refill_buffers >/dev/null
  if [[ $2 == read ]]; then fio_run "$1" write "$3" "$4" --refill_buffers >/dev/null; fi
  fio_run "$1" read "$3" "$4" >/dev/null
}

strata_run() {  # op block depth; prints "MB/s CPU-s-per-GB"
  "$STRATA" io-bench --path "$DIR" --size "${SIZE_MIB}MiB" --block-size "$(to_bytes "$2")" \
      --queue-depth "$3" --threads "$THREADS" --op "$1" --json $STRATA_FLAGS |
    "$py" -c "
import json, sys
j = json.loads(sys.stdin.readline())
print('%.1f %.4f' % (j['MBps'], j['cpu_s_per_GB']))"
}

echo "strata swap engine vs fio: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs ($(lscpu | sed -n 's/^Model name: *//p' | head -1)), kernel $(uname -r), $(fio --version)"
device=$(df --output=source "$DIR" | tail -1)
[[ -n "$RAM_LOOP" ]] && device="$RAM_LOOP: RAM-backed, ${RAM_DEVICE_GIB} GiB in /dev/shm, direct I/O"
echo "directory $DIR ($(stat -f -c %T "$DIR") on $device), ${SIZE_MIB} MiB per run, $THREADS thread(s)/job(s), $PAIRS pairs per case"
echo "fio buffers: $FIO_BUFFERS; fio's file: ${HISTORIES[*]} (FIO_HISTORY=$FIO_HISTORY)"
echo "strata: $STRATA io-bench --path $DIR --size ${SIZE_MIB}MiB --block-size B --queue-depth Q --threads $THREADS --op OP --json $STRATA_FLAGS"
echo "fio:    fio --filename=$DIR/fio-bench-HISTORY.dat --ioengine=io_uring --direct=1 --rw=OP --bs=B --iodepth=Q --numjobs=$THREADS --size=$((JOB_MIB))m --offset_increment=$((JOB_MIB))m --iomem=$FIO_IOMEM"
echo
printf "%-22s %4s %8s %12s %12s %7s %14s %12s\n" "case" "pair" "fio file" "strata MB/s" \
  "fio MB/s" "ratio" "strata CPU/GB" "fio CPU/GB"

# The median ratio's interval (bench/median_interval.py): a median below its target whose
# interval still reaches the target cannot be told from it with this many pairs; a whole
# interval below the target can.
median_interval() { "$py" "$(dirname "${BASH_SOURCE[0]}")/median_interval.py" "$@"; }
median() { printf "%s\n" "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

# Each pair times strata once and fio once on each history's file, in an order that rotates
# from pair to pair, so no tool always runs first or right after another.
TOOLS=(strata "${HISTORIES[@]}")
declare -a SUMMARY
start=$SECONDS
for op in $OPS; do
  for bs in $BLOCKS; do
    for qd in $DEPTHS; do
      name="$op bs=$bs qd=$qd"
      scpu=()
      declare -A ratios=() fmbps=() fcpu=() f=() fc=()
      for ((p = 1; p <= PAIRS; p++)); do
        for ((t = 0; t < ${#TOOLS[@]}; t++)); do
          tool=${TOOLS[(t + p - 1) % ${#TOOLS[@]}]}
          if [[ $tool == strata ]]; then
            read -r s sc < <(strata_run "$op" "$bs" "$qd")
          else
            fio_prepare "$tool" "$op" "$bs" "$qd"
            read -r "f[$tool]" "fc[$tool]" < <(fio_run "$tool" "$op" "$bs" "$qd")
          fi
        done
        scpu+=("$sc")
        for h in "${HISTORIES[@]}"; do
          r=$("$py" -c "print('%.3f' % ($s / ${f[$h]}))")
          ratios[$h]+=" $r"
          fmbps[$h]+=" ${f[$h]}"
          fcpu[$h]+=" ${fc[$h]}"
          printf "%-22s %4d %8s %12s %12s %7s %14s %12s\n" "$name" "$p" "$h" "$s" "${f[$h]}" "$r" \
            "$sc" "${fc[$h]}"
        done
      done
      # fio at its best: the history whose median fio rate is higher in this case.
      best=${HISTORIES[0]}
      for h in "${HISTORIES[@]}"; do
        if "$py" -c "import sys; sys.exit(not $(median ${fmbps[$h]}) > $(median ${fmbps[$best]}))"; then
          best=$h
        fi
      done
      order=("$best")
      for h in "${HISTORIES[@]}"; do [[ $h == "$best" ]] || order+=("$h"); done
      for h in "${order[@]}"; do
        med=$(median ${ratios[$h]})
        read -r lo hi cover < <(median_interval ${ratios[$h]})
        target=$([[ $bs == 1m ]] && echo 1.0 || echo 0.95)
        role=$([[ $h == "$best" ]] && echo "fio's best" || echo "other")
        SUMMARY+=("$(printf "%-22s fio file %-4s (%-10s fio %7.1f MB/s)  median ratio %.3f  [%s, %s] at %s%%  (pairs:%s)  CPU s/GB strata %.4f fio %.4f" \
          "$name" "$h" "$role," "$(median ${fmbps[$h]})" "$med" "$lo" "$hi" "$cover" \
          "${ratios[$h]}" "$(median "${scpu[@]}")" "$(median ${fcpu[$h]})")|$med|$target|$hi|$role")
      done
      unset ratios fmbps fcpu f fc
    done
  done
done

echo
echo "median strata/fio per case, [interval for the median] (target >= 0.95, >= 1.0 at 1 MiB)," \
  "judged against fio's faster file history:"
fails=0
for line in "${SUMMARY[@]}"; do
  IFS='|' read -r text med target hi role <<<"$line"
  verdict=$("$py" -c "print('ok' if $med >= $target else
    'BELOW TARGET (the interval reaches it: not told apart)' if $hi >= $target else
    'BELOW TARGET (the whole interval is below)')")
  if [[ $role == other ]]; then
    echo "      $text  ($([[ $verdict == ok ]] && echo ok || echo below) against this file)"
    continue
  fi
  [[ $verdict == ok ]] || fails=$((fails + 1))
  echo "  $text  $verdict"
done
echo "total $((SECONDS - start)) s; $fails case(s) below target"
