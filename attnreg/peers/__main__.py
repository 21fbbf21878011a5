"""python -m attnreg.peers"""

from .run import main

raise SystemExit(main())
