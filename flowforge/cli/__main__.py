import sys

from flowforge.cli import main

sys.exit(main())
