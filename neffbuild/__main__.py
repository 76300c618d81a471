from neffbuild.cli.entry import main

main()
