from xtokspec.cli import main

raise SystemExit(main())
