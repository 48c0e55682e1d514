import os
import sys

# pytest runs with --import-mode=importlib (no test dir on sys.path): make hydro_helpers importable.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
