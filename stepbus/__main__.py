import sys

from stepbus.cli import main

sys.exit(main())
