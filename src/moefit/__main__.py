import sys

from moefit.cli import main

sys.exit(main())
