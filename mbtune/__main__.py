from mbtune.cli import main

main()
