import sys
from pathlib import Path

# The testkit sits next to the tests; make it importable whatever pytest's rootdir is.
sys.path.insert(0, str(Path(__file__).parent))
