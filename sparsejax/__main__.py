from sparsejax.cli import main

raise SystemExit(main())
