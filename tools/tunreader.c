// SPDX-License-Identifier: GPL-2.0
/*
 * tunreader - the user-space end of one tun/tap queue: read and count.
 *
 * usage: tunreader (--fd N | --dev NAME --flags HEX) [--tap] [--vnet-hdr N]
 *                  [--delay-us N] [--paused] [--cpu C]
 *
 *   --fd N        use an inherited, already attached tun fd (the test keeps
 *                 its own copy, so it can TUNSETQUEUE it while we read)
 *   --dev/--flags attach with TUNSETIFF (new queue on a multi-queue device)
 *   --tap         frames carry an Ethernet header (IFF_TAP)
 *   --vnet-hdr N  every packet starts with an N-byte virtio-net header
 *   --delay-us N  sleep N us after each packet: a slow consumer
 *   --paused      attach, but do not read until told "go"
 *
 * Control: one command per line on stdin, answers are JSON lines on stdout.
 *   go | pause         resume / stop reading (packets stay in the ring)
 *   stat               print the counters
 *   wait KEY N MS      answer once counter KEY >= N ("result":"ok"), or
 *                      once MS ms passed without reading any packet
 *                      ("result":"stall"). KEY: pkts ours pktgen idK
 *   empty              read until the queue has nothing left (read() says
 *                      EAGAIN), then answer ("result":"empty"); refused
 *                      while paused or detached ("result":"not-reading")
 *   quit (or EOF)      print the counters and exit
 *
 * Counters: pkts/bytes (everything read), ours (UDP carrying udpburst's
 * "NDRP" header; per sender id in "per_id"), pktgen (pktgen's magic),
 * other, bad (length fields that do not match what read() returned, i.e.
 * a mis-parsed virtio-net header), ebadfd (reads refused because the queue
 * was detached with TUNSETQUEUE; we keep retrying), read_errors, reads
 * (every read() on the tun fd, the empty ones included) and wakeups (poll()
 * returns that found the tun fd readable): reads/pkts and pkts/wakeups are
 * what one packet costs the reader in syscalls and sleeps.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "pktclass.h"

#define BATCH 64

struct counters {
	unsigned long long pkts, bytes, ours, pktgen, other, bad;
	unsigned long long ebadfd, read_errors, reads, wakeups;
	unsigned long long per_id[MAX_IDS];
};

static struct counters cnt;
static int running = 1;

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
}

static void print_counters(const char *event, const char *result)
{
	int i;

	printf("{\"event\":\"%s\"", event);
	if (result)
		printf(",\"result\":\"%s\"", result);
	printf(",\"running\":%s,\"pkts\":%llu,\"bytes\":%llu,\"ours\":%llu,"
	       "\"pktgen\":%llu,\"other\":%llu,\"bad\":%llu,\"ebadfd\":%llu,"
	       "\"read_errors\":%llu,\"reads\":%llu,\"wakeups\":%llu,"
	       "\"per_id\":[",
	       running ? "true" : "false", cnt.pkts, cnt.bytes, cnt.ours,
	       cnt.pktgen, cnt.other, cnt.bad, cnt.ebadfd, cnt.read_errors,
	       cnt.reads, cnt.wakeups);
	for (i = 0; i < MAX_IDS; i++)
		printf("%s%llu", i ? "," : "", cnt.per_id[i]);
	printf("]}\n");
	fflush(stdout);
}

static unsigned long long counter(const char *key)
{
	if (!strcmp(key, "pkts"))
		return cnt.pkts;
	if (!strcmp(key, "ours"))
		return cnt.ours;
	if (!strcmp(key, "pktgen"))
		return cnt.pktgen;
	if (!strncmp(key, "id", 2)) {
		int id = atoi(key + 2);

		if (id >= 0 && id < MAX_IDS)
			return cnt.per_id[id];
	}
	return 0;
}

static void classify(const unsigned char *p, size_t len, int tap, size_t vnet)
{
	uint32_t id = 0, seq = 0;

	if (len < vnet) {
		cnt.bad++;
		return;
	}
	switch (pkt_classify(p + vnet, len - vnet, tap, &id, &seq)) {
	case PKT_OURS:
		cnt.ours++;
		if (id < MAX_IDS)
			cnt.per_id[id]++;
		break;
	case PKT_PKTGEN:
		cnt.pktgen++;
		break;
	case PKT_OTHER:
		cnt.other++;
		break;
	default:
		cnt.bad++;
	}
}

/* packet buffer and what read_one() needs of the options */
static unsigned char buf[65536 + 256];
static long delay_us;
static uint64_t last_progress;

/*
 * Read and count one packet: 1 if one was read, 0 if the queue has none
 * (EAGAIN, EINTR), -1 if the fd cannot be read now (detached queue, error).
 */
static int read_one(int fd, int tap, size_t vnet)
{
	ssize_t r = read(fd, buf, sizeof(buf));

	cnt.reads++;
	if (r < 0) {
		if (errno == EAGAIN || errno == EINTR)
			return 0;
		if (errno == EBADFD)
			cnt.ebadfd++;
		else
			cnt.read_errors++;
		return -1;
	}
	cnt.pkts++;
	cnt.bytes += (unsigned long long)r;
	classify(buf, (size_t)r, tap, vnet);
	last_progress = now_ms();
	if (delay_us > 0) {
		struct timespec ts = {
			.tv_sec = delay_us / 1000000,
			.tv_nsec = (delay_us % 1000000) * 1000,
		};
		nanosleep(&ts, NULL);
	}
	return 1;
}

/* "empty": read until read() finds the queue empty; 0 if it cannot read */
static int drain_queue(int fd, int tap, size_t vnet)
{
	int r;

	while ((r = read_one(fd, tap, vnet)) > 0)
		;
	return r == 0;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: tunreader (--fd N | --dev NAME --flags HEX) [--tap]\n"
		"                 [--vnet-hdr N] [--delay-us N] [--paused] [--cpu C]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "fd", required_argument, NULL, 'F' },
		{ "dev", required_argument, NULL, 'd' },
		{ "flags", required_argument, NULL, 'f' },
		{ "tap", no_argument, NULL, 't' },
		{ "vnet-hdr", required_argument, NULL, 'v' },
		{ "delay-us", required_argument, NULL, 'D' },
		{ "paused", no_argument, NULL, 'P' },
		{ "cpu", required_argument, NULL, 'c' },
		{ NULL, 0, NULL, 0 },
	};
	int fd = -1, tap = 0, cpu = -1, c;
	const char *dev = NULL;
	unsigned long flags = 0;
	size_t vnet = 0;
	int stdin_open = 1, detached = 0;
	/* pending "wait" */
	char wait_key[32] = "";
	unsigned long long wait_n = 0;
	uint64_t wait_ms = 0;
	char line[256];
	size_t line_len = 0;

	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'F': fd = atoi(optarg); break;
		case 'd': dev = optarg; break;
		case 'f': flags = strtoul(optarg, NULL, 0); break;
		case 't': tap = 1; break;
		case 'v': vnet = (size_t)atoi(optarg); break;
		case 'D': delay_us = atol(optarg); break;
		case 'P': running = 0; break;
		case 'c': cpu = atoi(optarg); break;
		default: usage();
		}
	}
	if ((fd < 0) == !dev)
		usage();
	signal(SIGPIPE, SIG_IGN);

	if (cpu >= 0) {
		cpu_set_t set;

		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		if (sched_setaffinity(0, sizeof(set), &set)) {
			perror("tunreader: sched_setaffinity");
			return 2;
		}
	}
	if (dev) {
		struct ifreq ifr;

		fd = open("/dev/net/tun", O_RDWR);
		if (fd < 0) {
			perror("tunreader: /dev/net/tun");
			return 2;
		}
		memset(&ifr, 0, sizeof(ifr));
		snprintf(ifr.ifr_name, IFNAMSIZ, "%s", dev);
		ifr.ifr_flags = (short)flags;
		if (ioctl(fd, TUNSETIFF, &ifr)) {
			perror("tunreader: TUNSETIFF");
			return 2;
		}
	}
	if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK)) {
		perror("tunreader: O_NONBLOCK");
		return 2;
	}
	print_counters("ready", NULL);

	for (;;) {
		struct pollfd pfd[2];
		int n = 0, timeout = -1, tun_idx = -1;
		uint64_t now;

		if (stdin_open) {
			pfd[n].fd = 0;
			pfd[n].events = POLLIN;
			n++;
		}
		if (running && !detached) {
			pfd[n].fd = fd;
			pfd[n].events = POLLIN;
			tun_idx = n++;
		}
		if (running && detached)
			timeout = 2;	/* retry the read, the queue may be back */
		if (wait_key[0]) {
			now = now_ms();
			if (now >= last_progress + wait_ms) {
				print_counters("wait", "stall");
				wait_key[0] = 0;
				continue;
			}
			if (timeout < 0 || (uint64_t)timeout > last_progress + wait_ms - now)
				timeout = (int)(last_progress + wait_ms - now);
		}
		if (!n && timeout < 0)
			break;	/* stdin closed and nothing to do */
		if (poll(pfd, (nfds_t)n, timeout) < 0) {
			if (errno == EINTR)
				continue;
			perror("tunreader: poll");
			return 2;
		}

		if (running && (detached ||
				(tun_idx >= 0 && pfd[tun_idx].revents))) {
			int i;

			if (!detached)
				cnt.wakeups++;
			detached = 0;
			for (i = 0; i < BATCH && running; i++) {
				int r = read_one(fd, tap, vnet);

				if (r <= 0) {
					detached = r < 0;	/* back off, retry */
					break;
				}
				if (wait_key[0] && counter(wait_key) >= wait_n) {
					print_counters("wait", "ok");
					wait_key[0] = 0;
				}
			}
		}

		if (stdin_open && pfd[0].revents) {
			ssize_t r = read(0, line + line_len, sizeof(line) - 1 - line_len);
			char *nl;

			if (r <= 0) {
				stdin_open = 0;
				break;	/* EOF: the test is done with us */
			}
			line_len += (size_t)r;
			line[line_len] = 0;
			while ((nl = strchr(line, '\n'))) {
				char cmd[32] = "", key[32] = "";
				unsigned long long a = 0, b = 0;

				*nl = 0;
				sscanf(line, "%31s %31s %llu %llu", cmd, key, &a, &b);
				if (!strcmp(cmd, "go")) {
					running = 1;
					last_progress = now_ms();
					print_counters("go", NULL);
				} else if (!strcmp(cmd, "pause")) {
					running = 0;
					print_counters("pause", NULL);
				} else if (!strcmp(cmd, "stat")) {
					print_counters("stat", NULL);
				} else if (!strcmp(cmd, "wait")) {
					if (counter(key) >= a) {
						print_counters("wait", "ok");
					} else {
						snprintf(wait_key, sizeof(wait_key), "%s", key);
						wait_n = a;
						wait_ms = b;
						last_progress = now_ms();
					}
				} else if (!strcmp(cmd, "empty")) {
					int ok = running && !detached &&
						 drain_queue(fd, tap, vnet);

					print_counters("empty", ok ? "empty" : "not-reading");
				} else if (!strcmp(cmd, "quit")) {
					print_counters("quit", NULL);
					return 0;
				} else if (cmd[0]) {
					printf("{\"event\":\"error\",\"unknown\":\"%s\"}\n", cmd);
					fflush(stdout);
				}
				line_len -= (size_t)(nl + 1 - line);
				memmove(line, nl + 1, line_len);
				line[line_len] = 0;
			}
			if (line_len >= sizeof(line) - 1)
				line_len = 0;	/* overlong garbage */
		}
	}
	print_counters("quit", NULL);
	return 0;
}
