from mtpkit.cli.entry import main

main()
