from superinfer.cli import main

raise SystemExit(main())
