"""python -m attnreg.tools.peers"""

from .run import main

raise SystemExit(main())
