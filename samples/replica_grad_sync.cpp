// replica-grad-sync: the DDP gradient-sync experiment (ResNet-18, random 3x224x224 images,
// 9 classes, 2 images per process, one forward/backward):
//   replica-launch --nproc-per-node 4 -- replica-grad-sync
// Every rank prints its own loss — they differ, each rank saw other images — then the same
// gradient element, fc.weight.grad[0][0], before and after DDP's all-reduce: the local values
// differ, the synchronised one is identical on every rank. DDP averages gradients inside
// backward, so the replicas stay in step although their losses differ.
#include <cstdio>
#include <thread>

#include <CLI/CLI.hpp>

#include "cli/program.h"

#include "engine/data/dataset.h"
#include "engine/error.h"
#include "parallel/comm/process_group.h"
#include "parallel/engines/ddp_engine.h"
#include "parallel/loop/distributed_sampler.h"
#include "parallel/rendezvous/rendezvous.h"

using namespace replica;

namespace {

// The classifier's weight: the last matrix of the model (ResNets' fc.weight, the CNN's last
// linear layer), whose gradient every model has.
const Param& classifier_weight(TrainEngine& e) {
  const Param* found = nullptr;
  for (const Param* p : e.model().params())
    if (p->value.ndim() == 2) found = p;
  REPLICA_CHECK(found != nullptr, "the model has no linear layer");
  return *found;
}

float weight_grad_00(TrainEngine& e) {
  const Param& p = classifier_weight(e);
  Tensor h;
  e.primary().run([&] {
    h = to_host(e.primary(), p.grad.view(0, {1}));
    e.primary().synchronize();
  });
  return h.f32()[0];
}

int run(int argc, char** argv) {
  std::string model = "resnet18";
  int64_t per_rank = 2, classes = 9, size = 10000, seed = 0;
  int image = 224;
  CLI::App app{"replica-grad-sync: per-rank losses differ, all-reduced gradients agree"};
  app.add_option("--model", model, "model")->capture_default_str();
  app.add_option("--batch-per-rank", per_rank,
                 "images per process (at most its share of --dataset-size)")
      ->capture_default_str();
  app.add_option("--image-size", image, "random images are 3 x S x S")->capture_default_str();
  app.add_option("--num-classes", classes, "classes")->capture_default_str();
  app.add_option("--dataset-size", size, "random images in the data set")->capture_default_str();
  app.add_option("--seed", seed, "initialisation and data seed")->capture_default_str();
  if (auto code = parse_cli(app, argc, argv)) return *code;
  REPLICA_USAGE_CHECK(per_rank >= 1 && image >= 32 && classes >= 2 && size >= 1,
                      "batch, image size (>= 32), classes (>= 2) and dataset size must be positive");
  REPLICA_USAGE_CHECK(seed >= 0, "--seed must be >= 0, got {}", seed);
  check_model_name(model);  // before the rendezvous: every rank says it alike, none half-connected
  check_gloo_interface();
  // A rank's batch is drawn from its DistributedSampler share of the data set, known from the
  // launcher's environment before the rendezvous: a larger batch is refused here, alike on
  // every rank and before anything is allocated, where it was cut to the share without a word.
  const Rendezvous ranks = rendezvous_env_ranks();
  SamplerOptions so;
  so.dataset_size = size;
  so.num_replicas = ranks.world_size;
  so.rank = ranks.rank;
  so.seed = uint64_t(seed);
  so.local_ranks = ranks.local_world_size;
  DistributedSampler sampler(so);
  REPLICA_USAGE_CHECK(per_rank <= sampler.num_samples(),
                      "--batch-per-rank {}: a rank draws its batch from its share of the "
                      "--dataset-size {} images, {} with {} rank{}; give at most {}, or a larger "
                      "--dataset-size",
                      per_rank, size, sampler.num_samples(), ranks.world_size,
                      ranks.world_size == 1 ? "" : "s", sampler.num_samples());
  Rendezvous rv = rendezvous();
  EngineOptions o;
  o.model = model;
  o.input_shape = {3, image, image};
  o.num_classes = classes;
  o.seed = uint64_t(seed);
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.1f;
  o.threads_per_device = std::max(1, cpu_cores() / std::max(1, rv.local_world_size));

  auto data = make_synthetic(size, o.input_shape, int(classes), uint64_t(seed));
  std::vector<int64_t> idx = sampler.indices();
  idx.resize(size_t(per_rank));  // the first per_rank of the share
  const Batch batch = read_batch(*data, idx, host_allocator());

  // The same batch on a lone replica (a group of one): the gradient before any all-reduce.
  const Device device{DeviceType::CPU, rv.local_rank, 0};
  auto local = make_ddp_engine(device, GroupOptions{}, o, DdpOptions{});
  local->train_step(batch);
  const float before = weight_grad_00(*local);

  auto ddp = make_ddp_engine(device, group_options(rv, CommBackend::Gloo, std::chrono::minutes(5)),
                             o, DdpOptions{});
  ddp->train_step(batch);
  const float loss = ddp->last_loss();
  const float after = weight_grad_00(*ddp);
  std::printf("rank %d: loss %.4f   %s.grad[0][0]: local %+.6f, after all-reduce %+.6f\n",
              rv.rank, loss, classifier_weight(*ddp).name.c_str(), before, after);
  std::fflush(stdout);
  ddp->finish();  // every rank is done with the collectives before any leaves
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return replica::run_program("replica-grad-sync", [&] { return run(argc, argv); });
}
