from neffbuild.cli import main

main()
