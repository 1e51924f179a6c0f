"""pytest fixtures and hypothesis profiles; the shared references live in
helpers.py beside this file."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for `import helpers`

from lmmetrics import _core  # noqa: E402
from helpers import ISAS  # noqa: E402


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test on every SIMD path this machine supports."""
    before = _core.active_isa()
    _core.set_isa(request.param)
    yield request.param
    _core.set_isa(before)


# hypothesis profiles for the property suites (tests/properties/test_fuzz.py; tests
# with their own @settings, as test_properties.py, keep their counts):
# "ci" (the default) runs up to 800 examples per property test: 3,200 fuzz
# cases (4 properties) + 800 shape-mismatch cases + the two small exception
# spaces exhausted (14 + 24), about a minute on 2 cores;
# HYPOTHESIS_PROFILE=long runs up to 5,000 per test: 20,000 fuzz cases +
# 5,000 shape-mismatch cases (+ the 38 exhaustive ones).

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the property suites skip themselves, saying so
    pass
else:
    _SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile("ci", max_examples=800, deadline=None, suppress_health_check=_SLOW_OK,
                              print_blob=True)
    settings.register_profile("long", max_examples=5000, deadline=None, suppress_health_check=_SLOW_OK,
                              print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
