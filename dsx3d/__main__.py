import sys

from dsx3d.cli import main

sys.exit(main())
