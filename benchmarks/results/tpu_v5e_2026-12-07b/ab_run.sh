#!/usr/bin/env bash
# A/B on the chip: C = rope in bf16 + gated_silu barrier (the working tree), B = rope only, A = neither (HEAD).
set -u
V=l4b4_minimal_splash_context_unrolled
one() {
  rm -rf /tmp/device_check_runs
  STAGES=variants VARIANTS=$V EXTRA="train.steps=20" bash benchmarks/tpu/device_check.sh 2>&1 | grep -v "^installed" | sed "s/^/$1 /"
  mkdir -p $OUT/$1 && cp /tmp/device_check_runs/*.log $OUT/$1/ 2>/dev/null
}
S=$(date +%s)
one C
patch -s -R -p1 < ab/swiglu.patch; one B
patch -s -R -p1 < ab/rope.patch; one A
patch -s -p1 < ab/rope.patch; patch -s -p1 < ab/swiglu.patch
echo "elapsed $(( $(date +%s) - S )) s"
if [ $(( $(date +%s) - S )) -lt 380 ]; then
  rm -rf /tmp/device_check_runs; STAGES=profile PROFILE_VARIANT=$V bash benchmarks/tpu/device_check.sh 2>&1 | tail -3
fi
