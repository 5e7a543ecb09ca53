from mtpkit.cli.app import main

main()
