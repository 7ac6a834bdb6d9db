"""What the tests share, one module per job: launching kvbench and reading what it wrote (launch), assertions on
a run's one line, its files and its rows (asserts), argument presets more than one test file runs (args), trace
files (traces), synthetic result files (synth).

Test files and conftest.py import them one way, ``from helpers.launch import ROOT, mpiexec``: pytest puts tests/ on
sys.path (it has no __init__.py) before it imports conftest.py, the same under pytest-xdist's workers.  No test
module imports another test module; the modules here import each other relatively.
"""
