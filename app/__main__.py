import sys

from app.launcher import main

sys.exit(main())
