import sys

from stepbus.entry import main

sys.exit(main())
