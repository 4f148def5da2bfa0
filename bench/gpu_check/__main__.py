import sys

from bench.gpu_check.main import main

sys.exit(main(sys.argv[1:]))
