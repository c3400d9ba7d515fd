from reprotrain.train import main

main()
