#!/usr/bin/env bash
# Set up (Debian packages + .venv) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exits 5 when it collected no tests: that is a failure of the suite, not a pass.
exit $rc
