#!/bin/bash
# One device call of at most 10 minutes: GPU suite phases, each under its own time limit,
# so that whatever a phase finished comes back even when a limit cuts it short (a killed
# phase's results are bundled by --collect).
#   usage: tests/gpu/device_call.sh PHASE:SECONDS [PHASE:SECONDS ...]
#     PHASE: prepare | kernels (prepare's kernel tests alone) | alone | replay-serve (alone's first two files) | generation (its third)
#   e.g.   tests/gpu/device_call.sh prepare:330 replay-serve:200     (first call)
#          tests/gpu/device_call.sh generation:540                    (second call, right after)
#          tests/gpu/device_call.sh kernels:240                       (on a card under 100 GiB, an
#                                            H100: prepare leaves the kernel tests to this call)
G=tests/gpu
mkdir -p "$OUT"
S=$SECONDS
for step in "$@"; do
  phase=${step%%:*}; limit=${step##*:}
  case $phase in
    prepare) args=(--phase prepare) ;;
    alone) args=(--phase alone) ;;
    kernels) args=(--phase kernels) ;;
    replay-serve) args=(--phase alone $G/test_replay.py $G/test_serve.py) ;;
    generation) args=(--phase alone $G/test_generation.py) ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  PHASE_NAME=$phase timeout -k 10 $limit $G/run_on_device.sh "${args[@]}" > $OUT/run-$phase.txt 2>&1; rc=$?
  echo "$phase: exit $rc at $((SECONDS - S)) s"
  # timeout signals the whole process group; a phase it cut short left its results unbundled.
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && $G/run_on_device.sh --collect $phase-cut 2>&1 | grep bitwise_equal
  grep -v "^WARNING" $OUT/run-$phase.txt | grep -E "exit|prepared|passed|failed|bitwise_equal" | tail -8
done
