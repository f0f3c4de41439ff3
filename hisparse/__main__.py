from hisparse.cli import main

raise SystemExit(main())
