import os
import sys

# pytest runs with --import-mode=importlib: make squeezer_helpers importable by module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
