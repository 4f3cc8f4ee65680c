#!/usr/bin/env bash
# Set up with the test extras, then run the whole test suite on the CPU (`--fast` first: only the tests not marked
# slow, which leaves out processes, Ray, fuzzing, Prometheus and the large chi-square samples).
# As root on Debian/Ubuntu it also installs the system tools some tests use (hipcc to compile the HIP kernels for
# AMD GPUs, g++ for the CPU attention kernel, Prometheus to check the dashboards' queries); elsewhere those tests
# are skipped. CASCADE_NO_APT=1 opts out.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(hipcc libamdhip64-dev rocm-device-libs prometheus g++)
if [ "${CASCADE_NO_APT:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if ! command -v hipcc >/dev/null || ! command -v prometheus >/dev/null || ! command -v g++ >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
  fi
fi
bash scripts/setup.sh test
. .venv/bin/activate
# A pytest-xdist worker per core, up to four (CASCADE_TEST_WORKERS overrides; 1: everything in this process).
workers=${CASCADE_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
workers=$(( workers > 4 ? 4 : workers ))
if [ "${1:-}" = --fast ]; then
  shift
  [ "$workers" -gt 1 ] && set -- -n "$workers" "$@"
  exec python -m pytest -m "not slow" "$@"
fi
# The whole suite (no test chosen: only options such as -q): the workers take every module but Ray's, which then runs
# in one process (under xdist its worker died near the module's end, twice, and the run hung).
chosen=0
for arg in "$@"; do
  case "$arg" in -k* | -m* | -n* | --deselect* | --ignore* | -p) chosen=1 ;; -*) ;; *) chosen=1 ;; esac
done
if [ "$workers" -gt 1 ] && [ "$chosen" = 0 ]; then
  status=0
  python -m pytest -n "$workers" --ignore=tests/test_ray.py "$@" || status=$?
  python -m pytest tests/test_ray.py "$@" || status=$?
  exit "$status"
fi
python -m pytest "$@"
