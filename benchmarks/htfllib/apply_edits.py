"""The local edits that make HtFLlib (commit e959261) run fedistill's comparison on one CPU thread (issue 63, item 6).

HtFLlib is the reference, run outside the project and never vendored: clone it, then from its root

    python path/to/benchmarks/htfllib/apply_edits.py            # edits 1-7 (FedProto, FedGH, FedTGP, FD at HEAD,
                                                                # FML, LG-FedAvg, FedKD, FedMRL)
    python path/to/benchmarks/htfllib/apply_edits.py --fd-soft  # also edit 8, in a second clone, for FD
    python path/to/benchmarks/htfllib/apply_edits.py --keep-state DIR  # also edit 9 (a FedTGP diagnostic)

Every edit asserts that its anchor (one line of HtFLlib's code) is present exactly once, so a moved upstream fails
loudly instead of running something else. spec/experiments-hetero.md §5.1 says why each edit is there.
"""
import sys
import re
from pathlib import Path

S = Path("system")


def edit(path, old, new, count=1):
    text = (S / path).read_text()
    assert text.count(old) == count, (path, old, text.count(old))
    (S / path).write_text(text.replace(old, new))


# 1. torchvision has no CPU build beside torch 2.13's: import it only where a torchvision model is named.
edit("flcore/trainmodel/models.py", "import torchvision\n",
     "try:\n    import torchvision\nexcept Exception:  # edit 1\n    torchvision = None\n")
# 2. The small ResNets' stem takes the input's channels (MNIST has one).
edit("flcore/trainmodel/resnet.py", "        bn_block_num = 4, \n    ) -> None:",
     "        bn_block_num = 4, \n        in_channels: int = 3,  # edit 2\n    ) -> None:")
edit("flcore/trainmodel/resnet.py", "nn.Conv2d(3, self.inplanes,", "nn.Conv2d(in_channels, self.inplanes,")
# 3. main.py: only the compared methods' servers imported (the others pull in StyleGAN/diffusers code); the
#    one-channel 28x28 group; a -seed flag seeding torch, numpy and random; one torch thread.
main = (S / "main.py").read_text()
main = re.sub(r"from flcore\.servers\.server(gen|ktl_\w+|l2g_\w+|local) import .*\n", "", main)
for name in ["Local", "FedGen", "FedKTL_stylegan_xl", "FedKTL_stylegan_3", "FedKTL_stable_diffusion", "FedL2G_feat",
             "FedL2G_logit"]:
    main = main.replace(f"server = {name}(args, i)", "raise NotImplementedError  # edit 3")
main = main.replace('        if args.model_family == "HtFE-img-2":',
                    '        if args.model_family == "HtFE-mnist-3":  # edit 3\n'
                    '            args.models = [\n'
                    "                'FedAvgCNN(in_features=1, num_classes=args.num_classes, dim=1024)',\n"
                    "                'resnet4(num_classes=args.num_classes, in_channels=1)',\n"
                    "                'resnet6(num_classes=args.num_classes, in_channels=1)',\n"
                    '            ]\n\n'
                    '        elif args.model_family == "HtFE-img-2":', 1)
main = main.replace("    args = parser.parse_args()\n",
                    "    parser.add_argument('-seed', '--seed', type=int, default=0)  # edit 3\n"
                    "    args = parser.parse_args()\n"
                    "    import random; random.seed(args.seed); np.random.seed(args.seed); torch.manual_seed(args.seed)\n"
                    "    torch.set_num_threads(1)\n", 1)
(S / "main.py").write_text(main)
# 4. Every client model was initialised after torch.manual_seed(0): the run's seed instead.
edit("flcore/clients/clientbase.py", "        torch.manual_seed(0)\n", "        torch.manual_seed(args.seed)  # edit 4\n")
# 5. One machine-readable line per evaluation: pooled accuracy (HtFLlib's metric) and the mean over clients.
edit("flcore/servers/serverbase.py", '        print("Averaged Test Accuracy: {:.4f}".format(test_acc))\n',
     '        print("Averaged Test Accuracy: {:.4f}".format(test_acc))\n'
     '        import json; print("EVAL_JSON " + json.dumps({"pooled": float(test_acc), '
     '"client_mean": float(np.mean(accs))}), flush=True)  # edit 5\n')
# 6. The loop evaluates before training, rounds 0..global_rounds, and trained once more after the last
#    evaluation: stop there (the same evaluated rows, one round less of work).
for server in ["serverfd", "serverproto", "servergh", "servertgp", "serverfml", "serverlg", "serverkd", "servermrl"]:
    edit(f"flcore/servers/{server}.py", "                self.evaluate()\n",
         "                self.evaluate()\n            if i == self.global_rounds:\n                break  # edit 6\n")
print("edits applied")
# 7. torch >= 2.6 loads with weights_only=True, which refuses HtFLlib's pickled whole models (its own files,
#    written by the same run): load them as torch < 2.6 did.
edit("flcore/clients/clientbase.py",
     'return torch.load(os.path.join(item_path, role + "_" + item_name + ".pt"))',
     'return torch.load(os.path.join(item_path, role + "_" + item_name + ".pt"), weights_only=False)  # edit 7')
print("edit 7 applied")
# 8. (--fd-soft) FD's distillation target as HtFLlib had it before its commit ca3e29a: the softmax of the global
#    class logits (fd.md ambiguity 1: the raw-logit target of HEAD diverges on both sides).
if "--fd-soft" in sys.argv[1:]:
    edit("flcore/clients/clientfd.py", "loss += self.loss(output, logit_new) * self.lamda",
         "loss += self.loss(output, logit_new.softmax(dim=1)) * self.lamda  # edit 8", count=2)
    print("edit 8 applied")
# 9. (--keep-state DIR, FedTGP only; a diagnostic, not for the comparison's runs) after each evaluation i, copy the
#    run's saved items (every client's model and uploaded prototypes, the server's TGP and global prototypes) to
#    DIR/r<i>, which the run otherwise deletes at its end: benchmarks/htfllib/fedtgp_round2_cross.py reads them.
if "--keep-state" in sys.argv[1:]:
    keep = Path(sys.argv[sys.argv.index("--keep-state") + 1]).resolve()
    edit("flcore/servers/servertgp.py", "                self.evaluate()\n",
         "                self.evaluate()\n"
         f"                import shutil; shutil.copytree(self.save_folder_name, '{keep}/r' + str(i), "
         "dirs_exist_ok=True)  # edit 9\n")
    print(f"edit 9 applied (state kept under {keep})")
