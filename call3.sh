set -uo pipefail
SKIP_BENCH=1 bash benchmarks/device_run.sh -p no:cacheprovider -rs
cd /tmp && python3 -m pytest $OLDPWD/tests/test_autograd.py -q -p no:cacheprovider -k "checkpoint or inference or deterministic or autocast" -v 2>&1 | grep -E "PASS|FAIL|SKIP|passed|failed" | tail -12
