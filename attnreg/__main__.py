"""`python -m attnreg ...` is the `attnreg` command (for environments without the script)."""
import sys

from .tools.cli import main

sys.exit(main())
