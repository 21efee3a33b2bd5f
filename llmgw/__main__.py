from llmgw.cli import main

main()
