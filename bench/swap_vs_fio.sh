#!/usr/bin/env bash
# Strata's swap engine against fio on the same file system: sequential read and write at 1 MiB
# and 8 MiB blocks, queue depth 8 and 32, in alternating strata/fio pairs; prints every pair and
# the median ratio strata/fio per case (target: at least 0.95).
#
# Usage: bench/swap_vs_fio.sh [STRATA_BINARY]
#   DIR=/path/on/the/drive   directory to test (default /tmp/strata-swap-vs-fio; not tmpfs)
#   SIZE_MIB=1024            bytes per run, in MiB (both tools)
#   PAIRS=7                  strata/fio pairs per case
#   THREADS=1                strata --threads = fio numjobs (each job a 1/THREADS slice)
#   BLOCKS="1 8" DEPTHS="8 32" OPS="read write"   the cases
#   STRATA_FLAGS=...          extra io-bench flags, e.g. "--no-huge-pages" for a control run
#                            with staging buffers in 4 KiB pages, as fio keeps its buffers
#
# What makes the two comparable: both use io_uring with O_DIRECT on the same directory, the same
# bytes, block size, queue depth and job count, and sequential offsets from 0. Each timed run
# follows an untimed write and read of the whole file by the same tool (strata io-bench verifies
# its data that way before timing; fio does the same passes here), so both read data written
# moments before and both write over blocks that were already written. Both read back random
# data that differs from block to block (strata io-bench always writes such data; fio's untimed
# write uses --refill_buffers): this virtual disk reads a file made of one repeated buffer (fio's
# default) at a different speed (in our runs, less often at its fast host-cache speed). fio's
# timed writes keep its default repeated buffer, its fastest setting (--refill_buffers costs it
# CPU). The disk varies +-20% from run to run, so runs alternate strata/fio (who goes first swaps
# each pair) and the ratio reported is the median of the pairs.
set -euo pipefail

STRATA=${1:-${STRATA:-build/strata}}
DIR=${DIR:-/tmp/strata-swap-vs-fio}
SIZE_MIB=${SIZE_MIB:-1024}
PAIRS=${PAIRS:-7}
THREADS=${THREADS:-1}
BLOCKS=${BLOCKS:-"1 8"}
DEPTHS=${DEPTHS:-"8 32"}
OPS=${OPS:-"read write"}
STRATA_FLAGS=${STRATA_FLAGS:-}

command -v fio >/dev/null || { echo "fio is not installed (apt-get install fio)" >&2; exit 2; }
[[ -x "$STRATA" ]] || { echo "no strata binary at $STRATA (build it, or pass its path)" >&2; exit 2; }
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

FIO_FILE="$DIR/fio-bench.dat"
trap 'rm -f "$FIO_FILE"' EXIT
JOB_MIB=$(( SIZE_MIB / THREADS ))

# fio with THREADS jobs, each over its own slice of one file. Prints MB/s (1e6 bytes/s).
fio_run() {  # op block_mib depth [extra fio options]
  local op=$1 bs=$2 qd=$3 key
  shift 3
  key=$([[ $op == read ]] && echo read || echo write)
  fio --name=swap --filename="$FIO_FILE" --ioengine=io_uring --direct=1 --rw="$op" \
      --bs="${bs}m" --iodepth="$qd" --numjobs="$THREADS" --size="${JOB_MIB}m" \
      --offset_increment="${JOB_MIB}m" --group_reporting --output-format=json "$@" \
    | python3 -c "import json,sys; print('%.1f' % (json.load(sys.stdin)['jobs'][0]['$key']['bw_bytes'] / 1e6))"
}

# The untimed passes strata io-bench makes before timing: write everything (random data that
# differs from block to block), read it back.
fio_prepare() {  # block_mib depth
  fio_run write "$1" "$2" --refill_buffers >/dev/null
  fio_run read "$1" "$2" >/dev/null
}

strata_run() {  # op block_mib depth
  "$STRATA" io-bench --path "$DIR" --size "${SIZE_MIB}MiB" --block-size "${2}MiB" \
      --queue-depth "$3" --threads "$THREADS" --op "$1" --json $STRATA_FLAGS \
    | python3 -c "import json,sys; print('%.1f' % json.loads(sys.stdin.readline())['MBps'])"
}

echo "strata swap engine vs fio: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, kernel $(uname -r), $(fio --version)"
echo "directory $DIR ($(stat -f -c %T "$DIR")), ${SIZE_MIB} MiB per run, $THREADS thread(s)/job(s), $PAIRS pairs per case"
echo "strata: $STRATA io-bench --path $DIR --size ${SIZE_MIB}MiB --block-size B --queue-depth Q --threads $THREADS --op OP --json $STRATA_FLAGS"
echo "fio:    fio --filename=$FIO_FILE --ioengine=io_uring --direct=1 --rw=OP --bs=B --iodepth=Q --numjobs=$THREADS --size=$((JOB_MIB))m --offset_increment=$((JOB_MIB))m"
echo
printf "%-22s %4s %12s %12s %7s\n" "case" "pair" "strata MB/s" "fio MB/s" "ratio"

declare -a SUMMARY
start=$SECONDS
for op in $OPS; do
  for bs in $BLOCKS; do
    for qd in $DEPTHS; do
      name="$op bs=${bs}MiB qd=$qd"
      ratios=()
      for ((p = 1; p <= PAIRS; p++)); do
        if (( p % 2 == 1 )); then
          s=$(strata_run "$op" "$bs" "$qd")
          fio_prepare "$bs" "$qd"
          f=$(fio_run "$op" "$bs" "$qd")
        else
          fio_prepare "$bs" "$qd"
          f=$(fio_run "$op" "$bs" "$qd")
          s=$(strata_run "$op" "$bs" "$qd")
        fi
        r=$(python3 -c "print('%.3f' % ($s / $f))")
        ratios+=("$r")
        printf "%-22s %4d %12s %12s %7s\n" "$name" "$p" "$s" "$f" "$r"
      done
      med=$(printf "%s\n" "${ratios[@]}" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
      SUMMARY+=("$(printf "%-22s median ratio %.3f  (pairs: %s)" "$name" "$med" "${ratios[*]}")|$med")
    done
  done
done

echo
echo "median strata/fio per case (target >= 0.95):"
fails=0
for line in "${SUMMARY[@]}"; do
  med=${line##*|}
  verdict=$(python3 -c "print('ok' if $med >= 0.95 else 'BELOW TARGET')")
  [[ $verdict == ok ]] || fails=$((fails + 1))
  echo "  ${line%|*}  $verdict"
done
echo "total $((SECONDS - start)) s; $fails case(s) below target"
