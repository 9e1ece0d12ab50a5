from minillm.cli import main

main()
