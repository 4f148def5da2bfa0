"""The tests' shared fakes and helpers: one place, so that no test module
imports another. Test modules import from here; fixtures built on these
helpers are exposed through conftest.py files."""
