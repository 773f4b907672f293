import sys

from onnx_genrt.cli import main

sys.exit(main())
