from mtpkit.cli import main

main()
