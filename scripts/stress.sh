#!/usr/bin/env bash
# Run one command many times with glibc's heap checks on, and count how each run ended.
#
#   scripts/stress.sh [-n RUNS] [-t MAX_SECONDS] [-o LOG_DIR] [-k] [-m check|plain|asan] [--] COMMAND [ARGS...]
#
#   -n RUNS         runs at most (default 20)
#   -t MAX_SECONDS  total wall time: no run starts after it, a running one is stopped at it (default 3600)
#   -o LOG_DIR      where each failing run's log is kept (default /tmp/stress-<date>-<pid>)
#   -k              keep every run's log, not only the failing ones
#   -m MODE         check (default): the heap checks below; plain: glibc's own allocator with its tcache
#                   (whose always-on checks said "malloc(): unaligned tcache chunk detected" in issue #54,
#                   and which the checked allocator bypasses) and MALLOC_PERTURB_ only; asan: AddressSanitizer's
#                   runtime preloaded (LD_PRELOAD=libasan.so, gcc's): its allocator puts poisoned red zones
#                   around every block and reports, with both stacks, a double or invalid free, and a
#                   read or write past a block or after its free made through an intercepted libc call
#                   (memcpy, memset, memmove, str*: how uninstrumented libraries such as torch, gloo or oneDNN
#                   copy); a plain store of uninstrumented code is not checked (valgrind would, far slower)
#
# Each run gets (in its environment; COMMAND sees STRESS_RUN=<1..RUNS> to make its folders distinct):
#   MALLOC_CHECK_=3, GLIBC_TUNABLES=glibc.malloc.check=3 and, on glibc >= 2.34 (where the checks moved out of
#   libc.so), LD_PRELOAD=libc_malloc_debug.so.0: without that library glibc >= 2.34 ignores both settings.
#   With the check on, each block carries a check byte past its end (a write past the block aborts at
#   free/realloc with "free(): invalid pointer" and the like), a double free aborts, and the checked
#   allocator bypasses the tcache; MALLOC_PERTURB_=<random byte 1-255 per run> fills freed memory with that
#   byte (and new memory with its complement), so a read after free sees garbage, not the old value.
#   PYTHONFAULTHANDLER=1 (every Python thread's stack on SIGSEGV/SIGABRT/SIGBUS/SIGFPE/SIGILL) and
#   LIBC_FATAL_STDERR_=1 (glibc's fatal messages go to stderr, not the terminal).
# Before the runs, a 1-byte overflow compiled with gcc (when there is one) is run under the same settings
# and must abort: the line "heap checks: active (...)" says it did. Exit status: 0 when every run exited 0,
# else 1; 2 for a usage error. Outside the test suite (minutes to hours).
set -uo pipefail

runs=20 max_s=3600 log_dir="" keep_all=0 mode=check
usage() {  # with a reason: one line naming what is wrong, then the usage line
  [ -n "${1:-}" ] && echo "stress.sh: $1" >&2
  echo "usage: $0 [-n RUNS] [-t MAX_SECONDS] [-o LOG_DIR] [-k] [-m check|plain|asan] [--] COMMAND [ARGS...] (-h: help)" >&2
  exit 2
}
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the header comment is the help
  sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
while getopts "n:t:o:km:" opt; do
  case $opt in
    n) runs=$OPTARG ;; t) max_s=$OPTARG ;; o) log_dir=$OPTARG ;; k) keep_all=1 ;; m) mode=$OPTARG ;; *) usage ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || usage "no COMMAND to run"
[[ $runs =~ ^[0-9]+$ ]] || usage "-n $runs: RUNS must be a whole number"
[[ $max_s =~ ^[0-9]+$ ]] || usage "-t $max_s: MAX_SECONDS must be a whole number"
[[ $mode =~ ^(check|plain|asan)$ ]] || usage "-m $mode: MODE must be check, plain or asan"
log_dir=${log_dir:-/tmp/stress-$(date +%Y%m%d-%H%M%S)-$$}
mkdir -p "$log_dir"

# --- the heap-check environment -----------------------------------------------------------------------
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
check_env=(MALLOC_CHECK_=3 "GLIBC_TUNABLES=${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.check=3"
           PYTHONFAULTHANDLER=1 LIBC_FATAL_STDERR_=1)
mechanism="MALLOC_CHECK_=3 + GLIBC_TUNABLES=glibc.malloc.check=3"
if [ "$mode" = plain ]; then
  check_env=(PYTHONFAULTHANDLER=1 LIBC_FATAL_STDERR_=1)
  mechanism="plain glibc ${glibc:-unknown} allocator (tcache on) + MALLOC_PERTURB_"
elif [ "$mode" = asan ]; then
  asan=$(gcc -print-file-name=libasan.so 2>/dev/null || true)
  [ -n "$asan" ] && [ "$asan" != libasan.so ] && [ -e "$asan" ] || asan=$(ls /usr/lib*/*/libasan.so.[0-9]* 2>/dev/null | head -1)
  [ -n "$asan" ] || { echo "stress.sh: -m asan needs AddressSanitizer's runtime (libasan.so): install gcc (e.g. apt install gcc)" >&2; exit 2; }
  # libstdc++ preloaded beside it: ASan's __cxa_throw interceptor binds at start-up, and without the C++
  # runtime loaded by then the first C++ exception (torch throws and catches some) fails its CHECK.
  # verify_asan_link_order=0: preloaded into a program not built with it; abort_on_error: a report ends
  # the process with SIGABRT, which the count below sees; detect_leaks=0: Python frees little at exit
  stdcxx=$(gcc -print-file-name=libstdc++.so.6 2>/dev/null || true)
  [ -e "$stdcxx" ] || stdcxx=$(ls /usr/lib*/*/libstdc++.so.6 2>/dev/null | head -1)
  check_env=("LD_PRELOAD=$asan${stdcxx:+ $stdcxx}${LD_PRELOAD:+ $LD_PRELOAD}" PYTHONFAULTHANDLER=1 LIBC_FATAL_STDERR_=1
             "ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0:abort_on_error=1:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}")
  mechanism="AddressSanitizer preloaded ($asan)"
elif [ -n "$glibc" ] && [ "$(printf '%s\n' 2.34 "$glibc" | sort -V | head -1)" = 2.34 ]; then
  if /sbin/ldconfig -p 2>/dev/null | grep -q 'libc_malloc_debug.so.0' || ls /lib*/*/libc_malloc_debug.so.0 >/dev/null 2>&1; then
    check_env+=("LD_PRELOAD=libc_malloc_debug.so.0${LD_PRELOAD:+ $LD_PRELOAD}")
    mechanism="LD_PRELOAD=libc_malloc_debug.so.0 + $mechanism (glibc $glibc)"
  else
    mechanism="NONE: glibc $glibc needs libc_malloc_debug.so.0, which is not installed"
  fi
else
  mechanism="$mechanism (glibc ${glibc:-unknown})"
fi

probe_dir=$(mktemp -d)
if [ "$mode" = plain ]; then
  echo "heap checks: $mechanism"
elif command -v gcc >/dev/null; then
  if [ "$mode" = asan ]; then  # the path ASan checks in uninstrumented code: an intercepted call
    printf '#include <stdlib.h>\n#include <string.h>\nint main(void){char *p = malloc(20); memset(p, 65, 21); free(p); return 0;}\n' > "$probe_dir/p.c"
  else
    printf '#include <stdlib.h>\nint main(void){char *p = malloc(20); p[20] = 65; free(p); return 0;}\n' > "$probe_dir/p.c"
  fi
  if gcc -O0 -o "$probe_dir/p" "$probe_dir/p.c" 2>/dev/null; then
    { env "${check_env[@]}" MALLOC_PERTURB_=165 "$probe_dir/p" > "$probe_dir/out" 2>&1; } 2>/dev/null
    probe=$?
    if [ $probe -gt 128 ]; then
      echo "heap checks: active ($mechanism; a 1-byte overflow aborted: $(head -c 80 "$probe_dir/out" | tr '\n' ' '))"
    else
      echo "heap checks: NOT active ($mechanism; a 1-byte overflow exited $probe)"
    fi
  fi
else
  echo "heap checks: $mechanism (unverified: no gcc for the probe)"
fi
rm -rf "$probe_dir"

# --- the runs -----------------------------------------------------------------------------------------
crash_pattern='AddressSanitizer|malloc\(\)|free\(\)|double free|corrupted|malloc_consolidate|munmap_chunk|realloc\(\)|Fatal Python error|Segmentation fault|most recent call first|ended with signal'
declare -A outcomes=() lines=()
start=$SECONDS done_runs=0 failed=0
for ((i = 1; i <= runs; i++)); do
  left=$((max_s - (SECONDS - start)))
  [ $left -gt 0 ] || break
  log="$log_dir/run-$i.log"
  perturb=$((RANDOM % 255 + 1))
  echo "=== run $i: MALLOC_PERTURB_=$perturb $*" > "$log"
  # timeout: the run ends at the deadline (its own process group first, then SIGKILL 15 s later)
  { env "${check_env[@]}" MALLOC_PERTURB_=$perturb STRESS_RUN=$i timeout -k 15 "$left" "$@" >> "$log" 2>&1; } 2>/dev/null
  rc=$?
  if [ $rc -eq 0 ]; then
    outcome="exit 0"
  elif [ $rc -eq 124 ]; then
    outcome="stopped at the -t deadline"
  elif [ $rc -gt 128 ] && name=$(kill -l $((rc - 128)) 2>/dev/null); then
    outcome="killed by signal SIG$name"
  else
    outcome="exit $rc"
  fi
  outcomes[$outcome]=$((${outcomes[$outcome]:-0} + 1))
  done_runs=$i
  # (glibc ends its message without a newline: faulthandler's first line follows on the same line)
  found=$(sed -E 's/(.)(Fatal Python error)/\1\n\2/' "$log" | grep -aE "$crash_pattern" | grep -av '^=== run' | sed -E 's/0x[0-9a-f]+/0x../g; s/^\[rank[0-9]+\]:? ?//' | sort -u)
  if [ $rc -ne 0 ] || [ -n "$found" ]; then
    failed=$((failed + 1))
    while IFS= read -r line; do
      [ -n "$line" ] && lines[$line]=$((${lines[$line]:-0} + 1))
    done <<< "$found"
    echo "run $i: $outcome (MALLOC_PERTURB_=$perturb); log kept: $log"
  else
    echo "run $i: $outcome (MALLOC_PERTURB_=$perturb)"
    [ $keep_all -eq 1 ] || rm -f "$log"
  fi
done

# --- the summary --------------------------------------------------------------------------------------
echo
echo "stress summary: $done_runs run(s) in $((SECONDS - start)) s of: $*"
echo "heap checks: $mechanism"
printf '%-8s %s\n' runs outcome
for outcome in "${!outcomes[@]}"; do printf '%-8s %s\n' "${outcomes[$outcome]}" "$outcome"; done | sort -k2
if [ ${#lines[@]} -gt 0 ]; then
  printf '%-8s %s\n' runs "glibc / faulthandler / launcher line (addresses masked)"
  for line in "${!lines[@]}"; do printf '%-8s %s\n' "${lines[$line]}" "$line"; done | sort -rn | head -40
fi
echo "failing runs' logs: $log_dir ($failed kept)"
[ $failed -eq 0 ]
