;;;; attacks.lisp -- `make bench-attacks`: what cheap attacks cost each
;;;; server, while a fresh client asks for /yo.
;;;;
;;;;   scripts/lisp.sh --load bench/attacks.lisp --eval '(gallop-bench-attacks:main)'
;;;;
;;;; Each attack runs against a fresh server process of each kind: native
;;;; (GALLOP:START), gallop (GALLOP:EASY-ACCEPTOR), stock (Hunchentoot's own,
;;;; for comparison) and, where it has the same thing to do, Debian's nginx.
;;;; Servers are bench/server.lisp with its defaults (1 GiB heap, 100
;;;; threads); only their timeouts are raised where said, so that the
;;;; attack's connections stay for the whole measurement.
;;;;
;;;;   silent   ATTACK_SILENT (12,000) connections that send nothing and
;;;;            ATTACK_SLOWLORIS (3,000) that send part of a head, then a
;;;;            header line every 10 s, held open (timeouts 120 s; nginx:
;;;;            client_header_timeout 120 s, worker_connections 20,000).
;;;;            Meanwhile ATTACK_PROBES (50) fresh GET /yo, one a second.
;;;;            Bar: every probe answered exactly, median under 50 ms.
;;;;   errors   wrk -c100 for ATTACK_ERROR_SECONDS (5) on /yo, then as long
;;;;            on /error, a handler that signals an error, three rounds, with
;;;;            the message log on (to a file).  Bar: /error's median rate at
;;;;            least half of /yo's, at most 8 KiB of log per error.  (nginx:
;;;;            no handler.)
;;;;   hangups  ATTACK_HANGUP_ROUNDS (3) rounds of 100 clients that each send
;;;;            POST /upload with Content-Length 100,000 and 1,000 octets of
;;;;            body, wait 3 s and close (the handler reads the body as a
;;;;            stream).  RSS after a full GC, before and after.  Bar: within
;;;;            32 MiB of before, the server alive and answering.  (nginx: no
;;;;            handler.)
;;;;   slowbody slowhttptest -B (R-U-Dead-Yet) against POST /upload, once per
;;;;            count in ATTACK_SLOWBODY ("1000,4000"): -c that many
;;;;            connections opened at 500 a second, each declaring a
;;;;            100,000-octet body and sending a few octets every 5 s.
;;;;            slowhttptest opens its connections once and ends when none
;;;;            is left; it is started again at once, for
;;;;            ATTACK_SLOWBODY_SECONDS (60) in all, so that the attack goes
;;;;            on; the probes start after its first 2 s.
;;;;            Default timeouts (nginx: client_body_timeout 20 s, and /upload
;;;;            discards the body).  Bar: every probe answered, median under
;;;;            50 ms, workers at most the CPUs plus 2, RSS within the body
;;;;            budget (an eighth of the heap) of its value at rest.
;;;;   uploads  8 curl clients at once POST 50 MiB each to /upload (4 with
;;;;            Content-Length, 4 chunked), at most 10 MB/s each, beside 5
;;;;            probes.  Bar: every upload answered with its length, every
;;;;            probe answered, RSS at most 32 MiB above its value at rest.
;;;;   tls-idle 10,000 TLS connections (stock: 150), each with a handshake and
;;;;            one GET /yo, left idle, then closed: bench/tls-hold.lisp's
;;;;            idle part, against servers answering HTTPS only (no probes).
;;;;            Bar: every connection held, RSS after a full GC once they
;;;;            closed within 20 MiB of before.  (nginx: not run.)
;;;;   readers  ATTACK_READERS (300) clients ask for /stream, 1 MiB streamed in
;;;;            16 KiB writes, and never read, for ATTACK_READER_SECONDS
;;;;            (60), beside the probes (one a second).  Default timeouts;
;;;;            Gallop's kinds also without the minimum data rate, as the
;;;;            control ("readers, no rate": the write timeout alone).  Bar:
;;;;            every client ended by the server, the last sooner than in the
;;;;            control (or the control still held some at the end), the log's lines about them at most one a
;;;;            minute.  (Past 100 such clients every worker waits for one,
;;;;            and a probe queued behind their requests waits too: the
;;;;            probes are shown, not part of the bar.)  (nginx: no handler.)
;;;; The WebSocket and streamed-answer attacks, against native, gallop and
;;;; stock (bench/server.lisp's /ws, /feed and /stream; on Hunchentoot's
;;;; kinds hunchensocket's shape, BENCH_SWITCHED=1: a handler that answers
;;;; 101 and keeps its thread, reading frames from the stream, with
;;;; hunchensocket's limits and 300 s timeout), each beside a fresh GET /yo
;;;; once a second for as long as it lasts, with the heap after a full GC
;;;; (the server's "gc") before and after:
;;;;   ws-fragments  ATTACK_WS_ROUNDS (10) rounds: ATTACK_WS_FRAGMENT_CLIENTS
;;;;            (50) WebSockets each send a text frame without FIN, then
;;;;            continuation frames without FIN, each ATTACK_WS_FRAME_BYTES
;;;;            (65,536), until the server closes (at most
;;;;            ATTACK_WS_ROUND_SECONDS, 30); the close codes; the heap after
;;;;            each round; then a fresh WebSocket must echo a message.
;;;;            (hunchensocket's shape closes at the first frame: 65,535
;;;;            octets is its largest.)
;;;;   ws-broadcast  ATTACK_WS_BROADCAST_CLIENTS (900) WebSockets join /feed
;;;;            (16 KiB to each every 20 ms from one thread) and never read,
;;;;            for ATTACK_WS_BROADCAST_SECONDS (30); the feed's counts.
;;;;   ws-burst  WebSockets opened 250 at a time until one is refused (the
;;;;            server's cap: gallop's :max-switched-threads, stock's thread
;;;;            limit), at most ATTACK_WS_BURST_MAX (6,000), then a first
;;;;            message sent on each at once; every one must be echoed within
;;;;            ATTACK_WS_BURST_WAIT (60) s.
;;;;   ws-silent  the server limited to ATTACK_WS_SILENT_FDS (256) fds
;;;;            (prlimit), ATTACK_WS_SILENT (300) WebSockets that send
;;;;            nothing (the switched shape without a timeout of its own);
;;;;            fresh GET /yo once a second (each waiting up to 10 s) until
;;;;            five in a row are answered, at most ATTACK_WS_SILENT_SECONDS
;;;;            (120): how long fresh clients were kept out.
;;;;   slow-read-stream  slowhttptest -X (ATTACK_SLOW_READ_CONNECTIONS, 500,
;;;;            connections at 200 a second, each reading 512 B a second
;;;;            through a 512-1,024-octet window) against /stream (1 MiB
;;;;            streamed in 16 KiB writes), started again as it ends, for
;;;;            ATTACK_SLOW_READ_SECONDS (30); the probes start after 2 s.
;;;;   Bar of each Gallop row: the server alive and answering, every probe
;;;;   answered (ws-silent: answered again before the run ends, and within
;;;;   15 s of the server's idle timeout for them), the probes' median at
;;;;   most 50 ms, the heap after a full GC back within 32 MiB of its start;
;;;;   ws-fragments: the fresh WebSocket echoed; ws-burst: every first
;;;;   message answered; slow-read-stream: workers at most the CPUs plus 2.
;;;;   (nginx: not run.)
;;;; A monitor samples the server's RSS and threads (nginx: master and
;;;; workers summed) every 250 ms, and Gallop's pool (GALLOP:STATS :THREADS,
;;;; the workers) every second.  Prints one Markdown table; exits 1 when a
;;;; Gallop row misses its bar, 2 when the harness broke.  Traffic goes to
;;;; 127.0.0.1 only; each attack is bounded in time.
;;;;
;;;; Environment: ATTACK_KINDS ("native,gallop,stock,nginx"), ATTACK_CASES
;;;; ("silent,errors,hangups,slowbody,uploads,tls-idle,readers,ws-fragments,
;;;; ws-broadcast,ws-burst,ws-silent,slow-read-stream"), the counts above,
;;;; ATTACK_PORT (18520).

(load (merge-pathnames "process.lisp" (or *load-truename* *default-pathname-defaults*)))
(load (merge-pathnames "sockets.lisp" (or *load-truename* *default-pathname-defaults*)))

(defpackage #:gallop-bench-attacks
  (:use #:common-lisp #:gallop-bench-process #:gallop-bench-sockets)
  (:export #:main))
(in-package #:gallop-bench-attacks)

(defparameter *kinds* (env-list "ATTACK_KINDS" '("native" "gallop" "stock" "nginx")))
(defparameter *cases* (env-list "ATTACK_CASES" '("silent" "errors" "hangups" "slowbody" "uploads"
                                                 "tls-idle" "readers" "ws-fragments" "ws-broadcast"
                                                 "ws-burst" "ws-silent" "slow-read-stream")))
(defparameter *ws-attacks* '("ws-fragments" "ws-broadcast" "ws-burst" "ws-silent" "slow-read-stream")
  "The attacks on WebSockets and streamed answers: their bar is WS-BAR-MISSED's.")
(defparameter *readers* (env-int "ATTACK_READERS" 300))
(defparameter *reader-seconds* (env-int "ATTACK_READER_SECONDS" 60))
(defparameter *slowbody* (mapcar #'parse-integer (env-list "ATTACK_SLOWBODY" '("1000" "4000"))))
(defparameter *slowbody-seconds* (env-int "ATTACK_SLOWBODY_SECONDS" 60))
(defparameter *silent* (env-int "ATTACK_SILENT" 12000))
(defparameter *slowloris* (env-int "ATTACK_SLOWLORIS" 3000))
(defparameter *probes* (env-int "ATTACK_PROBES" 50))
(defparameter *error-seconds* (env-int "ATTACK_ERROR_SECONDS" 5))
(defparameter *hangup-rounds* (env-int "ATTACK_HANGUP_ROUNDS" 3))
(defparameter *port* (env-int "ATTACK_PORT" 18520))
(defparameter *ws-fragment-clients* (env-int "ATTACK_WS_FRAGMENT_CLIENTS" 50))
(defparameter *ws-rounds* (env-int "ATTACK_WS_ROUNDS" 10))
(defparameter *ws-round-seconds* (env-int "ATTACK_WS_ROUND_SECONDS" 30))
(defparameter *ws-frame-bytes* (env-int "ATTACK_WS_FRAME_BYTES" 65536))
(defparameter *ws-broadcast-clients* (env-int "ATTACK_WS_BROADCAST_CLIENTS" 900))
(defparameter *ws-broadcast-seconds* (env-int "ATTACK_WS_BROADCAST_SECONDS" 30))
(defparameter *ws-burst-max* (env-int "ATTACK_WS_BURST_MAX" 6000))
(defparameter *ws-burst-wait* (env-int "ATTACK_WS_BURST_WAIT" 60))
(defparameter *ws-silent* (env-int "ATTACK_WS_SILENT" 300))
(defparameter *ws-silent-fds* (env-int "ATTACK_WS_SILENT_FDS" 256))
(defparameter *ws-silent-seconds* (env-int "ATTACK_WS_SILENT_SECONDS" 120))
(defparameter *slow-read-connections* (env-int "ATTACK_SLOW_READ_CONNECTIONS" 500))
(defparameter *slow-read-seconds* (env-int "ATTACK_SLOW_READ_SECONDS" 30))
(defparameter *goal-ms* 50
  "A probe's median must be under this (the WebSocket and streamed-answer
attacks: at most this).")
(defparameter *heap-goal-mb* 32
  "The WebSocket and streamed-answer attacks: the heap after a full GC must
end within this many MiB of its start.")
(defparameter *logs* (merge-pathnames "bench/results/tmp/attacks/" *repo*))

(defun gallop-kind-p (kind) (member kind '("native" "gallop") :test #'string=))

;;; The server under attack: a bench/server.lisp child, or nginx

(defstruct target kind process pid port log)

(defun nginx-conf (dir port)
  (format nil "worker_processes 1;
worker_rlimit_nofile 20000;
daemon off;
error_log ~Aerror.log;
pid ~Anginx.pid;
events { worker_connections 20000; }
http {
  access_log off;
  client_body_temp_path ~Abody;
  proxy_temp_path ~Aproxy;
  fastcgi_temp_path ~Afastcgi;
  uwsgi_temp_path ~Auwsgi;
  scgi_temp_path ~Ascgi;
  client_header_timeout 120s;
  keepalive_timeout 120s;
  server {
    listen 127.0.0.1:~D;
    default_type text/plain;
    location = /yo { return 200 \"Hey!\"; }
    location = /upload { client_body_timeout 20s; return 200 \"ok\"; }
  }
}
" dir dir dir dir dir dir dir port))

(defun start-target (kind port environment &key tls nofile)
  (let ((log (merge-pathnames (format nil "~A.log" kind) *logs*)))
    (if (string= kind "nginx")
        (let* ((dir (namestring (merge-pathnames "nginx/" *logs*)))
               (conf (concatenate 'string dir "nginx.conf")))
          (ensure-directories-exist dir)
          (with-open-file (out conf :direction :output :if-exists :supersede)
            (write-string (nginx-conf dir port) out))
          (let ((process (sb-ext:run-program "nginx" (list "-p" dir "-e" (concatenate 'string dir "error.log")
                                                           "-c" conf)
                                             :search t :wait nil :output nil :error nil)))
            (loop repeat 100 until (probe-yo port) do (sleep 0.1))
            (make-target :kind kind :process process :pid (sb-ext:process-pid process)
                         :port port :log log)))
        (multiple-value-bind (process pid)
            (start-bench-server kind port :environment environment :log log
                                          :if-log-exists :supersede :nofile nofile)
          (unless tls (probe-yo port))    ; the first request compiles dispatch
          (make-target :kind kind :process process :pid pid :port port :log log)))))

(defun stop-target (target)
  (kill-and-reap (target-process target)))

(defun children (pid)
  (let ((text (ignore-errors (uiop:read-file-string (format nil "/proc/~D/task/~D/children" pid pid)))))
    (and text (mapcar #'parse-integer (uiop:split-string (string-trim " " text))))))

(defun tree-status (pid)
  "VmRSS (KiB) and threads of PID and its children, summed."
  (let ((rss 0) (threads 0))
    (dolist (p (cons pid (children pid)) (values rss threads))
      (multiple-value-bind (r th) (proc-status p)
        (incf rss (or r 0))
        (incf threads (or th 0))))))

(defvar *ask-lock* (sb-thread:make-mutex :name "ask")
  "One question to the server at a time: the monitor's and the harness's.")

(defun server-gc-rss (target)
  "A full GC in the server, then its RSS in MiB."
  (sb-thread:with-mutex (*ask-lock*)
    (ask-gc (target-process target)))
  (round (or (proc-status (target-pid target)) 0) 1024))

(defun log-size (target)
  (or (ignore-errors (with-open-file (in (target-log target)) (file-length in))) 0))

;;; Watching: peaks of the server, and a fresh client once a second

(defstruct watch (peak-rss 0) (peak-threads 0) (peak-workers 0) (latencies '()) (failures 0)
  (done nil) (stop nil))

(defun server-workers (target)
  "Gallop's pool threads now (GALLOP:STATS :THREADS), or NIL for other kinds."
  (when (gallop-kind-p (target-kind target))
    (getf (sb-thread:with-mutex (*ask-lock*)
            (ask-stats (target-process target) 5))
          :threads)))

(defun start-watch (target &key (probes 0))
  "Sample TARGET every 250 ms; with PROBES, ask /yo once a second that many
times (T: until the function returned is called).  Returns the watch and a
function that waits for the probes, stops sampling and returns the watch."
  (let* ((w (make-watch))
         (lock (sb-thread:make-mutex))
         (monitor (sb-thread:make-thread
                   (lambda ()
                     (loop for tick from 0
                           until (watch-done w)
                           do (multiple-value-bind (rss threads) (tree-status (target-pid target))
                                (setf (watch-peak-rss w) (max (watch-peak-rss w) rss)
                                      (watch-peak-threads w) (max (watch-peak-threads w) threads)))
                              (when (zerop (mod tick 4))
                                (let ((workers (server-workers target)))
                                  (when workers
                                    (setf (watch-peak-workers w)
                                          (max (watch-peak-workers w) workers)))))
                              (sleep 0.25)))))
         (prober (and (or (eq probes t) (plusp probes))
                      (sb-thread:make-thread
                       (lambda ()
                         (loop for i from 0
                               while (if (eq probes t) (not (watch-stop w)) (< i probes))
                               do
                           (let ((start (get-internal-real-time))
                                 (ms (probe-yo (target-port target))))
                             (sb-thread:with-mutex (lock)
                               (if ms (push ms (watch-latencies w)) (incf (watch-failures w))))
                             (let ((left (- 1 (/ (- (get-internal-real-time) start)
                                                 internal-time-units-per-second))))
                               (when (plusp left) (sleep left))))))))))
    (values w (lambda ()
                (setf (watch-stop w) t)
                (when prober (sb-thread:join-thread prober))
                (setf (watch-done w) t)
                (sb-thread:join-thread monitor)
                w))))

(defun row (target attack w &rest more)
  (list* :kind (target-kind target) :attack attack
         :probes (+ (length (watch-latencies w)) (watch-failures w))
         :answered (length (watch-latencies w))
         :median-ms (upper-median (watch-latencies w) 0)
         :max-ms (reduce #'max (watch-latencies w) :initial-value 0)
         :peak-threads (watch-peak-threads w)
         :peak-rss-mb (round (watch-peak-rss w) 1024)
         ;; Alive, and a fresh GET /yo answered exactly.
         :alive (and (alive-p (target-process target))
                     (or (getf more :https) (probe-yo (target-port target)))
                     t)
         more))

;;; silent: connections that send nothing or part of a head

(defparameter *slowloris-head* (ascii (format nil "GET /yo HTTP/1.1~C~CHost: b~C~C"
                                              #\Return #\Linefeed #\Return #\Linefeed)))
(defparameter *slowloris-line* (ascii (format nil "X-a: b~C~C" #\Return #\Linefeed)))

(defun open-many (port count)
  "COUNT non-blocking connections to PORT (connecting); their fds."
  (let ((address (loopback-address port)))
    (loop repeat count
          for fd = (open-socket address)
          while fd
          collect fd)))

(defun connected-p (fd)
  "True if FD connected and the server has neither closed it nor answered."
  (let ((r (aref (poll-fds (vector fd) (vector (logior +pollin+ +pollout+)) 0) 0)))
    (and (logtest r +pollout+) (not (logtest r (logior +pollin+ +pollerr+ +pollhup+)))
         (zerop (socket-error fd)))))

(defun attack-silent (target)
  (let* ((port (target-port target))
         (silent (open-many port *silent*))
         (slow (open-many port *slowloris*)))
    (unwind-protect
         (progn
           ;; Until every connection completed (a full accept queue makes
           ;; the kernel retry a SYN after 1, 3, 7 s), at most 30 s.
           (loop repeat 30
                 until (every #'connected-p (append silent slow))
                 do (sleep 1))
           (let ((started (make-hash-table)))
             (flet ((keep-sending ()
                      ;; The head first, then a header line each time:
                      ;; a connection that completed late gets its head now.
                      (dolist (fd slow)
                        (when (connected-p fd)
                          (let ((octets (if (gethash fd started) *slowloris-line* *slowloris-head*)))
                            (send-some fd octets 0 (length octets))
                            (setf (gethash fd started) t))))))
               (keep-sending)
               (multiple-value-bind (w finish) (start-watch target :probes *probes*)
                 (loop repeat (ceiling *probes* 10)
                       do (sleep 10)
                          (keep-sending))
                 (funcall finish)
                 (row target "silent" w
                      :load (format nil "~D silent + ~D slowloris" *silent* *slowloris*)
                      :notes (format nil "held at the end: ~D + ~D"
                                     (count-if #'connected-p silent)
                                     (count-if #'connected-p slow)))))))
      (mapc #'%close silent)
      (mapc #'%close slow))))

;;; errors: a handler that signals an error

(defun wrk (port path seconds)
  "Run wrk -t1 -c100 on PATH: requests done, requests a second, non-2xx."
  (let ((r (parse-wrk (uiop:run-program (list "wrk" "-t1" "-c100" (format nil "-d~Ds" seconds)
                                              (format nil "http://127.0.0.1:~D~A" port path))
                                        :output :string :ignore-error-status t))))
    (values (or (getf r :requests) 0) (or (getf r :rps) 0) (getf r :non2xx))))

(defparameter *error-rounds* 3
  "Rounds of /yo then /error, each ATTACK_ERROR_SECONDS long: the ratio is of
the medians, so that the host's drift within the run counts for little.")

(defun attack-errors (target)
  (let ((port (target-port target))
        (ok-rates '()) (rates '()) (done 0) (bad 0) (log-bytes 0))
    (multiple-value-bind (w finish) (start-watch target)
      (dotimes (round *error-rounds*)
        (push (nth-value 1 (wrk port "/yo" *error-seconds*)) ok-rates)
        (let ((log-before (log-size target)))
          (multiple-value-bind (n rate non-2xx) (wrk port "/error" *error-seconds*)
            (incf done n)
            (incf bad non-2xx)
            (incf log-bytes (- (log-size target) log-before))
            (push rate rates))))
      (funcall finish)
      (let ((ratio (let ((ok (upper-median ok-rates 0)))
                     (if (plusp ok) (/ (upper-median rates 0) ok) 0)))
            (per-error (if (plusp bad) (round log-bytes bad) 0)))
        (row target "errors" w
             :load (format nil "wrk -c100, ~D x ~D s on each" *error-rounds* *error-seconds*)
             :rate-ratio ratio
             :log-per-error per-error
             :notes (format nil "/error ~D requests (~D not 2xx), ~,2F of /yo's rate (medians); ~
                                 log ~D B per error"
                            done bad ratio per-error))))))

;;; hangups: clients that send part of a body and close

(defun hangup-round (port clients)
  (let* ((head (ascii (format nil "POST /upload HTTP/1.1~C~CHost: b~C~CContent-Length: 100000~C~C~C~C"
                              #\Return #\Linefeed #\Return #\Linefeed
                              #\Return #\Linefeed #\Return #\Linefeed)))
         (body (make-array 1000 :element-type '(unsigned-byte 8) :initial-element 97))
         (fds (open-many port clients)))
    (sleep 0.5)
    (dolist (fd fds)
      (send-some fd head 0 (length head))
      (send-some fd body 0 (length body)))
    (sleep 3)
    (mapc #'%close fds)))

(defun attack-hangups (target)
  (let ((before (server-gc-rss target))
        (log-before (log-size target)))
    (multiple-value-bind (w finish) (start-watch target)
      (dotimes (i *hangup-rounds*)
        (hangup-round (target-port target) 100))
      (sleep 1)
      (funcall finish)
      (let ((after (server-gc-rss target)))
        (row target "hangups" w
             :load (format nil "~D x 100 clients" *hangup-rounds*)
             :rss-rise-mb (- after before)
             :notes (format nil "RSS after GC ~D -> ~D MiB; log +~D B"
                            before after (- (log-size target) log-before)))))))

;;; slowbody: slowhttptest -B

(defun slowhttptest-loop (port connections out deadline)
  "Run slowhttptest -B against PORT's /upload, again each time it ends, until
DEADLINE (internal real time); how many times it ran.  Its output goes to
OUT."
  (slowhttptest-until (lambda (left)
                        (list "-B" "-c" (princ-to-string connections) "-i" "5" "-s" "100000"
                              "-r" "500" "-l" (princ-to-string left) "-t" "POST"
                              "-u" (format nil "http://127.0.0.1:~D/upload" port)))
                      out deadline))

(defun slowhttptest-until (arguments out deadline)
  "Run slowhttptest with the arguments (ARGUMENTS seconds-left), again each
time it ends, until DEADLINE (internal real time); how many times it ran.
Its output goes to OUT."
  (let ((runs 0))
    (loop for left = (floor (- deadline (get-internal-real-time)) internal-time-units-per-second)
          while (> left 2)
          do (incf runs)
             (sb-ext:run-program "slowhttptest" (funcall arguments left)
                                 :search t :wait t :output (namestring out)
                                 :if-output-exists :append :error :output))
    runs))

(defun attack-slowbody (target connections)
  (let* ((port (target-port target))
         (rest-rss (round (tree-status (target-pid target)) 1024))
         (out (merge-pathnames (format nil "slowbody-~A-~D.txt" (target-kind target) connections)
                               *logs*))
         (deadline (+ (get-internal-real-time) (* *slowbody-seconds* internal-time-units-per-second)))
         (runs (list 0))
         (attacker (progn
                     (ignore-errors (delete-file out))
                     (sb-thread:make-thread
                      (lambda () (setf (car runs) (slowhttptest-loop port connections out deadline)))
                      :name "slowhttptest"))))
    (sleep 2)
    (multiple-value-bind (w finish) (start-watch target :probes *probes*)
      (funcall finish)
      (sb-thread:join-thread attacker :default nil)
      (row target "slowbody" w
           :load (format nil "slowhttptest -B -c~D" connections)
           :rest-rss-mb rest-rss
           :peak-workers (watch-peak-workers w)
           :notes (format nil "slowhttptest run ~D times; RSS at rest ~D MiB~
                               ~:[~;, workers at most ~:*~D~]"
                          (car runs) rest-rss
                          (and (gallop-kind-p (target-kind target)) (watch-peak-workers w)))))))

;;; uploads: large bodies at once

(defparameter *upload-bytes* (* 50 1024 1024))

(defun upload-file ()
  "A file of *UPLOAD-BYTES* octets of every value, made once."
  (let ((path (merge-pathnames "upload.bin" *logs*)))
    (unless (and (probe-file path)
                 (= *upload-bytes* (with-open-file (in path :element-type '(unsigned-byte 8))
                                     (file-length in))))
      (with-open-file (out path :direction :output :element-type '(unsigned-byte 8)
                                :if-exists :supersede)
        (let ((block (make-array 65536 :element-type '(unsigned-byte 8))))
          (dotimes (i (length block)) (setf (aref block i) (mod (* i 7) 251)))
          (loop repeat (floor *upload-bytes* (length block)) do (write-sequence block out)))))
    path))

(defun attack-uploads (target)
  (let* ((port (target-port target))
         (file (namestring (upload-file)))
         (rest-rss (progn (when (gallop-kind-p (target-kind target)) (server-gc-rss target))
                          (round (tree-status (target-pid target)) 1024)))
         (answers (make-array 8 :initial-element nil))
         (threads (loop for i below 8
                        collect (let ((i i))
                                  (sb-thread:make-thread
                                   (lambda ()
                                     (setf (aref answers i)
                                           (uiop:run-program
                                            (append (list "curl" "-s" "--max-time" "60"
                                                          "--limit-rate" "10M"
                                                          "-H" "Content-Type: application/octet-stream"
                                                          "--data-binary" (concatenate 'string "@" file))
                                                    (when (oddp i)
                                                      (list "-H" "Transfer-Encoding: chunked"))
                                                    (list (format nil "http://127.0.0.1:~D/upload" port)))
                                            :output :string :ignore-error-status t)))
                                   :name "upload")))))
    (multiple-value-bind (w finish) (start-watch target :probes 5)
      (mapc #'sb-thread:join-thread threads)
      (funcall finish)
      (let ((right (count (princ-to-string *upload-bytes*) answers :test #'equal)))
        (row target "uploads" w
             :load "8 x 50 MiB, 4 chunked"
             :rest-rss-mb rest-rss
             :uploads-answered right
             :notes (format nil "~D of 8 answered exactly; RSS at rest ~D MiB" right rest-rss))))))

;;; tls-idle: idle TLS connections, then closed (bench/tls-hold.lisp)

(defun tls-environment ()
  "The environment of a server answering HTTPS only, with a certificate made
for the run (loads bench/tls-hold.lisp, and cl+ssl, once)."
  (unless (find-package "GALLOP-BENCH-TLS-HOLD")
    (load (merge-pathnames "bench/tls-hold.lisp" *repo*)))
  (destructuring-bind (cert key) (make-tls-certificate (merge-pathnames "tls/" *logs*))
    (funcall (find-symbol "SERVER-ENVIRONMENT" "GALLOP-BENCH-TLS-HOLD") cert key)))

(defun attack-tls-idle (target)
  (multiple-value-bind (w finish) (start-watch target)
    (let ((idle (let ((*standard-output* (make-broadcast-stream)))
                  (funcall (find-symbol "RUN-IDLE" "GALLOP-BENCH-TLS-HOLD")
                           (target-kind target) (target-process target) (target-pid target)
                           (target-port target)))))
      (funcall finish)
      (flet ((mib (key) (round (or (getf idle key) 0))))
        (row target "tls-idle" w
             :load (format nil "~:D idle TLS connections" (getf idle :asked))
             :https t
             :tls-held (getf idle :held) :tls-asked (getf idle :asked)
             :rss-kept-mb (- (mib :rss-closed-mib) (mib :rss-before-mib))
             :notes (format nil "~:D held; RSS ~D MiB before, ~D with them, ~D once closed"
                            (getf idle :held) (mib :rss-before-mib) (mib :rss-after-mib)
                            (mib :rss-closed-mib)))))))

;;; readers: streamed answers nobody reads

(defparameter *stream-request* (ascii (format nil "GET /stream HTTP/1.1~C~CHost: b~C~C~C~C"
                                              #\Return #\Linefeed #\Return #\Linefeed
                                              #\Return #\Linefeed)))

(defun attack-readers (target &optional (attack "readers"))
  (let* ((port (target-port target))
         (log-before (log-size target))
         (fds (open-many port *readers*))
         (closed-at (make-hash-table))
         (start (get-internal-real-time)))
    (unwind-protect
         (progn
           (loop repeat 30 until (every #'connected-p fds) do (sleep 0.1))
           (dolist (fd fds)
             (send-some fd *stream-request* 0 (length *stream-request*)))
           (multiple-value-bind (w finish)
               (start-watch target :probes (min *probes* (- *reader-seconds* 2)))
             ;; When the server ends each connection (a reset, or its end
             ;; of file after the part of the answer the socket took).
             (loop while (< (- (get-internal-real-time) start)
                            (* *reader-seconds* internal-time-units-per-second))
                   do (dolist (fd fds)
                        (unless (gethash fd closed-at)
                          (let ((r (aref (poll-fds (vector fd) (vector +pollin+) 0) 0)))
                            (when (logtest r (logior +pollerr+ +pollhup+))
                              (setf (gethash fd closed-at)
                                    (/ (- (get-internal-real-time) start)
                                       internal-time-units-per-second))))))
                      (sleep 0.5))
             (funcall finish)
             (let* ((times (loop for v being the hash-values of closed-at collect v))
                    (held (- (length fds) (length times)))
                    (lines (count-log-lines target log-before)))
               (row target attack w
                    :load (format nil "~D clients reading nothing of /stream" (length fds))
                    :held held
                    :last-close (if times (reduce #'max times) 0)
                    :log-lines lines
                    :notes (format nil "ended by the server: ~D, the last after ~,1F s~
                                        ~:[~;; ~:*~D held at the end~]; log: ~D line~:P"
                                   (length times) (if times (reduce #'max times) 0)
                                   (and (plusp held) held) lines)))))
      (mapc #'%close fds))))

(defun count-log-lines (target from)
  "Lines the server logged past octet FROM of its log."
  (or (ignore-errors
       (with-open-file (in (target-log target) :element-type '(unsigned-byte 8))
         (file-position in from)
         (loop for b = (read-byte in nil) while b count (= b 10))))
      0))

;;; WebSockets: clients on raw sockets, for ws-fragments, ws-broadcast,
;;; ws-burst and ws-silent (bench/server.lisp's /ws and /feed)

(defconstant +pollrdhup+ #x2000 "poll(2): the peer closed its end.")

(defparameter *crlf* (format nil "~C~C" #\Return #\Linefeed))

(defun ws-handshake (path)
  (ascii (format nil "GET ~A HTTP/1.1~AHost: b~AUpgrade: websocket~AConnection: Upgrade~A~
                      Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==~ASec-WebSocket-Version: 13~A~A"
                 path *crlf* *crlf* *crlf* *crlf* *crlf* *crlf* *crlf*)))

(defun client-frame (opcode payload &key (fin t))
  "A frame as a client sends it, masked, of OPCODE with PAYLOAD (octets)."
  (let* ((n (length payload))
         (head (cond ((< n 126) 2) ((< n 65536) 4) (t 10)))
         (mask #(11 22 33 44))
         (frame (make-array (+ head 4 n) :element-type '(unsigned-byte 8))))
    (setf (aref frame 0) (logior (if fin #x80 0) opcode))
    (case head
      (2 (setf (aref frame 1) (logior #x80 n)))
      (4 (setf (aref frame 1) (logior #x80 126) (aref frame 2) (ldb (byte 8 8) n)
               (aref frame 3) (ldb (byte 8 0) n)))
      (t (setf (aref frame 1) (logior #x80 127))
       (dotimes (i 8) (setf (aref frame (+ 2 i)) (ldb (byte 8 (- 56 (* 8 i))) n)))))
    (replace frame mask :start1 head)
    (dotimes (i n frame)
      (setf (aref frame (+ head 4 i)) (logxor (aref payload i) (aref mask (mod i 4)))))))

(defstruct wsc
  "One client WebSocket: its fd, where its handshake is (:CONNECTING,
:HANDSHAKING, then :OPEN, :REFUSED or :FAILED; :CLOSED once the server's
close frame came, :GONE when the connection ended without one), what it
received and not yet taken, the close code it got, and the frame it is
sending (OUT) and how far."
  fd (state :connecting) (in (make-array 4096 :element-type '(unsigned-byte 8))) (fill 0)
  code out (out-pos 0))

(defun ws-receive (c)
  "Read what the server sent C into its buffer; NIL at its end or an error."
  (when (= (wsc-fill c) (length (wsc-in c)))
    (let ((bigger (make-array (* 2 (length (wsc-in c))) :element-type '(unsigned-byte 8))))
      (replace bigger (wsc-in c))
      (setf (wsc-in c) bigger)))
  (let ((n (receive-some (wsc-fd c) (wsc-in c) (wsc-fill c))))
    (cond ((eq n :again) t)
          ((and n (plusp n)) (incf (wsc-fill c) n) t))))

(defun next-frame (buffer end)
  "The first whole frame of BUFFER[0,END), as a server sends it (unmasked):
its opcode, and where its payload starts and ends; NIL when not all there."
  (when (>= end 2)
    (let* ((n (ldb (byte 7 0) (aref buffer 1)))
           (head (case n (126 4) (127 10) (t 2))))
      (when (>= end head)
        (let ((n (case n
                   (126 (+ (ash (aref buffer 2) 8) (aref buffer 3)))
                   (127 (loop with v = 0 for i from 2 below 10
                              do (setf v (+ (ash v 8) (aref buffer i))) finally (return v)))
                   (t n))))
          (when (>= end (+ head n))
            (values (ldb (byte 4 0) (aref buffer 0)) head (+ head n))))))))

(defun ws-frames (c)
  "The whole frames C received, taken from its buffer: (OPCODE . PAYLOAD) each."
  (let ((frames '()))
    (loop
      (multiple-value-bind (opcode start end) (next-frame (wsc-in c) (wsc-fill c))
        (unless opcode
          (return (nreverse frames)))
        (push (cons opcode (subseq (wsc-in c) start end)) frames)
        (replace (wsc-in c) (wsc-in c) :start2 end :end2 (wsc-fill c))
        (decf (wsc-fill c) end)))))

(defun close-code (payload)
  (if (>= (length payload) 2) (+ (ash (aref payload 0) 8) (aref payload 1)) 1005))

(defun ws-end (c state)
  "C ended in STATE: after the server's close frame, answer it with one
with the same code (as a client does) and close."
  (when (eq state :closed)
    (let* ((code (or (wsc-code c) 1000))
           (frame (client-frame 8 (make-array 2 :element-type '(unsigned-byte 8)
                                                :initial-contents (list (ldb (byte 8 8) code)
                                                                        (ldb (byte 8 0) code))))))
      (send-some (wsc-fd c) frame 0 (length frame))))
  (%close (wsc-fd c))
  (setf (wsc-state c) state))

(defun handshake-batch (conns request timeout)
  "Connect CONNS, send each REQUEST and read the answer's head, for up to
TIMEOUT seconds: each ends :OPEN (101), :REFUSED (another status), :FAILED,
or still :CONNECTING or :HANDSHAKING (no answer)."
  (let ((deadline (+ (now-ms) (* 1000 timeout)))
        (end-of-head (ascii (format nil "~A~A" *crlf* *crlf*))))
    (loop
      (let ((pending (remove-if-not (lambda (c) (member (wsc-state c) '(:connecting :handshaking)))
                                    conns)))
        (when (or (null pending) (> (now-ms) deadline))
          (return))
        (let ((revents (poll-fds (map 'vector #'wsc-fd pending)
                                 (map 'vector (lambda (c) (if (eq (wsc-state c) :connecting)
                                                              +pollout+ +pollin+))
                                      pending)
                                 100)))
          (loop for c in pending
                for r across revents
                do (cond ((zerop r))
                         ((eq (wsc-state c) :connecting)
                          (if (or (logtest r +pollerr+) (/= 0 (socket-error (wsc-fd c))))
                              (setf (wsc-state c) :failed)
                              (progn (send-some (wsc-fd c) request 0 (length request))
                                     (setf (wsc-state c) :handshaking))))
                         ((not (ws-receive c))
                          (setf (wsc-state c) :failed))
                         (t
                          (let ((at (search end-of-head (wsc-in c) :end2 (wsc-fill c))))
                            (when at
                              (setf (wsc-state c)
                                    (if (and (>= at 12)
                                             (equalp (subseq (wsc-in c) 0 12) (ascii "HTTP/1.1 101")))
                                        :open :refused))
                              ;; What follows the head is the server's first frames.
                              (replace (wsc-in c) (wsc-in c) :start2 (+ at 4) :end2 (wsc-fill c))
                              (decf (wsc-fill c) (+ at 4))))))))))))

(defun ws-open (port path count &key (batch 250) (timeout 15) stop-at-refusal keep-unanswered)
  "Try COUNT WebSockets on PATH, BATCH at a time, each batch's handshakes
answered within TIMEOUT seconds.  Returns those open (after their 101), and
how many were refused (another status), failed (closed, reset) or not
answered; STOP-AT-REFUSAL: no batch after one with a WebSocket not opened;
KEEP-UNANSWERED: those not answered are returned too, still connected."
  (let ((address (loopback-address port)) (request (ws-handshake path))
        (open '()) (refused 0) (failed 0) (unanswered 0) (tried 0))
    (loop while (< tried count)
          do (let* ((want (min batch (- count tried)))
                    (conns (loop repeat want
                                 for fd = (open-socket address)
                                 while fd collect (make-wsc :fd fd))))
               (incf tried want)
               (handshake-batch conns request timeout)
               (dolist (c conns)
                 (case (wsc-state c)
                   (:open (push c open))
                   (:refused (incf refused) (%close (wsc-fd c)))
                   ((:connecting :handshaking)
                    (incf unanswered)
                    (if keep-unanswered (push c open) (%close (wsc-fd c))))
                   (t (incf failed) (%close (wsc-fd c)))))
               (when (or (< (length conns) want)
                         (and stop-at-refusal (notevery (lambda (c) (eq (wsc-state c) :open)) conns)))
                 (return))))
    (values (nreverse open) refused failed unanswered)))

(defun ended-by-server (conns)
  "How many of the open CONNS the server has closed (read nothing: poll)."
  (let ((open (remove-if-not (lambda (c) (eq (wsc-state c) :open)) conns)))
    (count-if (lambda (r) (logtest r (logior +pollrdhup+ +pollhup+ +pollerr+)))
              (poll-fds (map 'vector #'wsc-fd open)
                        (make-array (length open) :initial-element (logior +pollin+ +pollrdhup+))
                        0))))

(defun close-all (conns)
  (dolist (c conns)
    (when (member (wsc-state c) '(:open :connecting :handshaking))
      (%close (wsc-fd c))
      (setf (wsc-state c) :gone))))

(defun ws-echo-check (port)
  "A fresh WebSocket on /ws: \"echoed\" when a message sent on it comes back
whole within 10 s, else what happened."
  (multiple-value-bind (conns refused failed) (ws-open port "/ws" 1 :timeout 10)
    (let ((c (first conns))
          (message (ascii "a fresh WebSocket")))
      (cond ((plusp refused) "handshake refused")
            ((plusp failed) "handshake failed")
            ((null c) "handshake not answered")
            (t
             (let ((frame (client-frame 1 message))
                   (deadline (+ (now-ms) 10000)))
               (send-some (wsc-fd c) frame 0 (length frame))
               (unwind-protect
                    (loop
                      (when (> (now-ms) deadline)
                        (return "no answer in 10 s"))
                      (let ((r (aref (poll-fds (vector (wsc-fd c)) (vector +pollin+) 100) 0)))
                        (when (plusp r)
                          (unless (ws-receive c)
                            (return "closed without a close frame"))
                          (dolist (f (ws-frames c))
                            (case (car f)
                              (1 (return-from ws-echo-check
                                   (if (equalp (cdr f) message) "echoed" "a wrong echo")))
                              (8 (return-from ws-echo-check
                                   (format nil "closed with ~D" (close-code (cdr f))))))))))
                 (%close (wsc-fd c)))))))))

(defun server-plist (target command prefix &optional (timeout 10))
  "The property list the server answers COMMAND with (\"feed\", \"settings\"), or NIL."
  (let ((line (sb-thread:with-mutex (*ask-lock*)
                (ask-process (target-process target) command prefix timeout))))
    (and line (let ((*read-eval* nil)) (ignore-errors (read-from-string line))))))

(defun server-gc-heap (target)
  "A full GC in the server, then its heap in use (dynamic usage) in MiB, or
NIL when it did not answer."
  (let ((octets (sb-thread:with-mutex (*ask-lock*)
                  (ask-gc (target-process target)))))
    (and octets (round octets (* 1024 1024)))))

(defun mib-or-dash (n) (if n (princ-to-string n) "–"))

;;; ws-fragments: messages that never end, refused

(defun fragments-round (port clients first next seconds)
  "CLIENTS WebSockets each send FIRST (a text frame without FIN), then NEXT (a
continuation without FIN) again and again until the server closes, for at
most SECONDS.  A property list: opened, close codes, how many ended without
a close frame or were still open, MiB sent."
  (multiple-value-bind (conns refused failed unanswered) (ws-open port "/ws" clients)
    (dolist (c conns) (setf (wsc-out c) first))
    (let ((deadline (+ (now-ms) (* 1000 seconds)))
          (sent 0))
      (loop
        (let ((live (remove-if-not (lambda (c) (eq (wsc-state c) :open)) conns)))
          (when (or (null live) (> (now-ms) deadline))
            (return))
          (let ((revents (poll-fds (map 'vector #'wsc-fd live)
                                   (make-array (length live)
                                               :initial-element (logior +pollin+ +pollout+))
                                   100)))
            (loop for c in live
                  for r across revents
                  do (when (logtest r (logior +pollin+ +pollerr+ +pollhup+))
                       (if (ws-receive c)
                           (let ((close (find 8 (ws-frames c) :key #'car)))
                             (when close
                               (setf (wsc-code c) (close-code (cdr close)))
                               (ws-end c :closed)))
                           (ws-end c :gone)))
                     (when (and (eq (wsc-state c) :open) (logtest r +pollout+))
                       (let* ((out (wsc-out c))
                              (n (send-some (wsc-fd c) out (wsc-out-pos c) (length out))))
                         (if (null n)
                             (ws-end c :gone)
                             (progn (incf sent n)
                                    (when (= (incf (wsc-out-pos c) n) (length out))
                                      (setf (wsc-out c) next (wsc-out-pos c) 0))))))))))
      (let ((still (count :open conns :key #'wsc-state))
            (codes '()))
        (close-all conns)
        (dolist (c conns)
          (when (wsc-code c)
            (let ((entry (assoc (wsc-code c) codes)))
              (if entry (incf (cdr entry)) (push (cons (wsc-code c) 1) codes)))))
        (list :opened (length conns) :not-opened (+ refused failed unanswered)
              :codes codes :no-frame (count :gone conns :key #'wsc-state) :still-open still
              :sent-mib (round sent (* 1024 1024)))))))

(defun attack-ws-fragments (target)
  (let* ((port (target-port target))
         (payload (make-array *ws-frame-bytes* :element-type '(unsigned-byte 8) :initial-element 97))
         (first (client-frame 1 payload :fin nil))
         (next (client-frame 0 payload :fin nil))
         (heap (list (server-gc-heap target)))
         (rounds '()))
    (multiple-value-bind (w finish) (start-watch target :probes t)
      (dotimes (i *ws-rounds*)
        (let ((round (fragments-round port *ws-fragment-clients* first next *ws-round-seconds*)))
          (push round rounds)
          (sleep 1)
          (push (server-gc-heap target) heap)
          (when (zerop (getf round :opened))
            (return))))
      (funcall finish)
      (let ((echo (ws-echo-check port))
            (heap (reverse heap))
            (codes '()))
        (dolist (round rounds)
          (loop for (code . n) in (getf round :codes)
                do (let ((entry (assoc code codes)))
                     (if entry (incf (cdr entry) n) (push (cons code n) codes)))))
        (flet ((total (key) (reduce #'+ rounds :key (lambda (r) (getf r key)))))
          (row target "ws-fragments" w
               :load (format nil "~D rounds of ~D WebSockets sending ~D KiB fragments"
                             (length rounds) *ws-fragment-clients* (floor *ws-frame-bytes* 1024))
               :heap-start-mb (first heap) :heap-end-mb (car (last heap))
               :echo echo
               :notes (format nil "heap after GC by round ~{~A~^ → ~} MiB; ~:D MiB sent; ~
                                   closes: ~:[none with a frame~;~:*~{~A~^, ~}~], ~D without a frame, ~
                                   ~D still open after ~D s~@[, ~D not opened~]; a fresh WebSocket: ~A"
                              (mapcar #'mib-or-dash heap) (total :sent-mib)
                              (loop for (code . n) in (sort codes #'< :key #'car)
                                    collect (format nil "~D × ~D" n code))
                              (total :no-frame) (total :still-open) *ws-round-seconds*
                              (let ((n (total :not-opened))) (and (plusp n) n))
                              echo)))))))

;;; ws-broadcast: a feed to clients that never read

(defun attack-ws-broadcast (target)
  (let ((port (target-port target))
        (heap-start (server-gc-heap target)))
    (multiple-value-bind (w finish) (start-watch target :probes t)
      (multiple-value-bind (conns refused failed unanswered)
          (ws-open port "/feed" *ws-broadcast-clients* :batch 300)
        (unwind-protect
             (progn
               (sleep *ws-broadcast-seconds*)
               (let ((feed (server-plist target "feed" "FEED "))
                     (ended (ended-by-server conns)))
                 (funcall finish)
                 (close-all conns)
                 (sleep 3)
                 (let ((heap-end (server-gc-heap target)))
                   (row target "ws-broadcast" w
                        :load (format nil "~D WebSockets on a 16 KiB feed every 20 ms, never read, ~D s"
                                      *ws-broadcast-clients* *ws-broadcast-seconds*)
                        :heap-start-mb heap-start :heap-end-mb heap-end
                        :notes (format nil "~D opened~@[, ~D refused~]~@[, ~D failed~]~@[, ~D not answered~]; ~
                                            ~D ended by the server; ~A; heap after GC ~A → ~A MiB"
                                       (length conns) (and (plusp refused) refused)
                                       (and (plusp failed) failed) (and (plusp unanswered) unanswered)
                                       ended
                                       (if feed
                                           (format nil "feed (~(~A~)): ~:D messages of ~D in ~D s, ~
                                                        ~:D sends~@[, ~D failed~]"
                                                   (getf feed :mode) (getf feed :ticks)
                                                   (* 50 *ws-broadcast-seconds*) *ws-broadcast-seconds*
                                                   (getf feed :sends)
                                                   (let ((e (getf feed :errors))) (and e (plusp e) e)))
                                           "the feed's counts not read (the server did not answer)")
                                       (mib-or-dash heap-start) (mib-or-dash heap-end))))))
          (close-all conns))))))

;;; ws-burst: a first message on as many held WebSockets as the server takes

(defun attack-ws-burst (target)
  (let ((port (target-port target))
        (heap-start (server-gc-heap target))
        (settings (server-plist target "settings" "SETTINGS ")))
    (multiple-value-bind (w finish) (start-watch target :probes t)
      (multiple-value-bind (conns refused failed unanswered)
          (ws-open port "/ws" *ws-burst-max* :stop-at-refusal t)
        (unwind-protect
             (let* ((message (ascii "the first message of a WebSocket held a while"))
                    (frame (client-frame 1 message))
                    (waiting (progn (sleep 1) (copy-list conns)))
                    (answered 0) (closed '()) (last-ms 0)
                    (start (now-ms))
                    (deadline (+ start (* 1000 *ws-burst-wait*))))
               ;; Every message at once, then the answers.
               (dolist (c conns)
                 (send-some (wsc-fd c) frame 0 (length frame)))
               (loop while (and waiting (< (now-ms) deadline))
                     do (let ((revents (poll-fds (map 'vector #'wsc-fd waiting)
                                                 (make-array (length waiting) :initial-element +pollin+)
                                                 100))
                              (done '()))
                          (loop for c in waiting
                                for r across revents
                                do (when (plusp r)
                                     (if (ws-receive c)
                                         (dolist (f (ws-frames c))
                                           (case (car f)
                                             (1 (when (equalp (cdr f) message)
                                                  (incf answered)
                                                  (setf last-ms (- (now-ms) start))
                                                  (push c done)))
                                             (8 (push (close-code (cdr f)) closed)
                                              (push c done))))
                                         (progn (push :no-frame closed) (push c done)))))
                          (setf waiting (set-difference waiting done))))
               (funcall finish)
               (close-all conns)
               (sleep 5)
               (let ((heap-end (server-gc-heap target)))
                 (row target "ws-burst" w
                      :load (format nil "a first message at once on each of the WebSockets held (at most ~:D)"
                                    *ws-burst-max*)
                      :heap-start-mb heap-start :heap-end-mb heap-end
                      :held (length conns) :burst-answered answered
                      :notes (format nil "~:D held (~A)~@[, ~D refused~]~@[, ~D failed~]~@[, ~D not answered~]; ~
                                          ~:D of ~:D answered, the last after ~:D ms~A~A; ~
                                          heap after GC ~A → ~A MiB"
                                     (length conns)
                                     (format nil "~A~@[; :max-switched-threads ~:D~]"
                                             (cond ((plusp refused) "the next refused")
                                                   ((plusp (+ failed unanswered)) "the next not opened")
                                                   (t "none refused"))
                                             (and (string= (target-kind target) "gallop")
                                                  (getf settings :max-switched-threads)))
                                     (and (plusp refused) refused) (and (plusp failed) failed)
                                     (and (plusp unanswered) unanswered)
                                     answered (length conns) last-ms
                                     (if closed
                                         (format nil "; ~D closed (~{~A~^, ~})" (length closed)
                                                 (remove-duplicates closed))
                                         "")
                                     (if waiting
                                         (format nil "; ~D with no answer in ~D s" (length waiting)
                                                 *ws-burst-wait*)
                                         "")
                                     (mib-or-dash heap-start) (mib-or-dash heap-end))
                      :max-switched-threads (getf settings :max-switched-threads))))
          (close-all conns))))))

;;; ws-silent: WebSockets that send nothing, under a low fd limit

(defun attack-ws-silent (target)
  (let* ((port (target-port target))
         (pid (target-pid target))
         (settings (server-plist target "settings" "SETTINGS "))
         ;; The timeout that ends a silent WebSocket on each server: Gallop's
         ;; for connections that switched protocols (native), falling back
         ;; to its read timeout under a handler that keeps its thread and
         ;; sets none (gallop); Hunchentoot's read timeout (stock).
         (idle (cond ((string= (target-kind target) "native")
                      (getf settings :upgraded-idle-timeout))
                     ((string= (target-kind target) "gallop")
                      (or (getf settings :upgraded-idle-timeout) (getf settings :read-timeout)))
                     (t (getf settings :read-timeout))))
         (heap-start (server-gc-heap target)))
    (multiple-value-bind (w finish) (start-watch target)
      (multiple-value-bind (conns refused failed unanswered)
          (ws-open port "/ws" *ws-silent* :keep-unanswered t :timeout 5 :batch *ws-silent*)
        (unwind-protect
             (let ((start (now-ms)) (streak 0) (back-at nil) (peak-fds 0))
               ;; A fresh client a second until five in a row are answered.
               (loop while (< (- (now-ms) start) (* 1000 *ws-silent-seconds*))
                     do (let* ((asked (now-ms))
                               (ms (probe-yo port)))
                          (setf peak-fds (max peak-fds (fd-count pid)))
                          (if ms
                              (progn (push ms (watch-latencies w))
                                     ;; Kept out until this answer came.
                                     (unless back-at (setf back-at (- (+ asked ms) start)))
                                     (incf streak))
                              (progn (incf (watch-failures w))
                                     (setf streak 0 back-at nil)))
                          (when (>= streak 5)
                            (return))
                          (let ((left (- 1000 (- (now-ms) asked))))
                            (when (plusp left) (sleep (/ left 1000))))))
               (let ((ended (ended-by-server conns))
                     (held (count :open conns :key #'wsc-state)))
                 (funcall finish)
                 (close-all conns)
                 (sleep 3)
                 (let ((heap-end (server-gc-heap target)))
                   (row target "ws-silent" w
                        :load (format nil "~D WebSockets sending nothing, server limited to ~D fds"
                                      *ws-silent* *ws-silent-fds*)
                        :heap-start-mb heap-start :heap-end-mb heap-end
                        :idle-timeout idle
                        :kept-out-ms (and back-at (>= streak 5) back-at)
                        :notes (format nil "fresh clients kept out ~:[past the run's ~D s~;~:*for ~,1F s~*~] ~
                                            (the server's idle timeout for them: ~:[none~;~:*~D s~]); ~
                                            ~D opened~@[, ~D refused~]~@[, ~D failed~]~@[, ~D not answered~], ~
                                            ~D ended by the server; server fds at most ~D; heap after GC ~A → ~A MiB"
                                       (and back-at (>= streak 5) (/ back-at 1000.0)) *ws-silent-seconds*
                                       idle held (and (plusp refused) refused)
                                       (and (plusp failed) failed) (and (plusp unanswered) unanswered)
                                       ended peak-fds (mib-or-dash heap-start) (mib-or-dash heap-end))))))
          (close-all conns))))))

;;; slow-read-stream: slowhttptest -X on a streamed answer

(defun attack-slow-read-stream (target)
  (let* ((port (target-port target))
         (heap-start (server-gc-heap target))
         (out (merge-pathnames (format nil "slow-read-stream-~A.txt" (target-kind target)) *logs*))
         (deadline (+ (get-internal-real-time) (* *slow-read-seconds* internal-time-units-per-second)))
         (runs (list 0))
         (attacker (progn
                     (ignore-errors (delete-file out))
                     (sb-thread:make-thread
                      (lambda ()
                        (setf (car runs)
                              (slowhttptest-until
                               (lambda (left)
                                 (list "-X" "-c" (princ-to-string *slow-read-connections*) "-r" "200"
                                       "-k" "1" "-n" "1" "-w" "512" "-y" "1024" "-z" "512" "-p" "3"
                                       "-l" (princ-to-string left)
                                       "-u" (format nil "http://127.0.0.1:~D/stream" port)))
                               out deadline)))
                      :name "slowhttptest"))))
    (sleep 2)
    (multiple-value-bind (w finish) (start-watch target :probes (max 1 (- *slow-read-seconds* 4)))
      (funcall finish)
      (sb-thread:join-thread attacker :default nil)
      (sleep 2)
      (let ((heap-end (server-gc-heap target)))
        (row target "slow-read-stream" w
             :load (format nil "slowhttptest -X -c~D on /stream (1 MiB streamed), reading 512 B/s"
                           *slow-read-connections*)
             :heap-start-mb heap-start :heap-end-mb heap-end
             :peak-workers (watch-peak-workers w)
             :notes (format nil "slowhttptest run ~D time~:P; threads at most ~D~
                                 ~:[~;, workers at most ~:*~D~]; heap after GC ~A → ~A MiB"
                            (car runs) (watch-peak-threads w)
                            (and (gallop-kind-p (target-kind target)) (watch-peak-workers w))
                            (mib-or-dash heap-start) (mib-or-dash heap-end)))))))

(defun ws-bar-missed (row)
  "Why a Gallop ROW of the WebSocket and streamed-answer attacks misses its
bar, or NIL: the server alive and answering; every probe answered, their
median at most *GOAL-MS* (ws-silent: fresh clients served again before
the run ends, and within 15 s of the server's default idle timeout for
WebSockets where it reports one); the heap after a full GC back within
*HEAP-GOAL-MB* of its start; and each attack's own."
  (let ((attack (getf row :attack))
        (start (getf row :heap-start-mb))
        (end (getf row :heap-end-mb)))
    (or (and (not (getf row :alive)) "the server died or stopped answering")
        (if (string= attack "ws-silent")
            (let ((idle (getf row :idle-timeout))
                  (kept (getf row :kept-out-ms)))
              ;; The idle timeout in force is the server's: Gallop's
              ;; setting where it has one (its probes time out after 10 s).
              (cond ((null kept) "fresh clients were still kept out at the end")
                    ((and idle (> kept (* 1000 (+ idle 15))))
                     "fresh clients were kept out past the idle timeout")))
            (and (/= (getf row :answered) (getf row :probes)) "a probe failed"))
        (and (> (getf row :median-ms) *goal-ms*) "the probes' median was too slow")
        (and (not (and start end)) "the heap was not measured (the server did not answer)")
        (and (> (- end start) *heap-goal-mb*)
             (format nil "the heap after a full GC ended ~D MiB above its start" (- end start)))
        (and (string= attack "ws-fragments") (not (equal (getf row :echo) "echoed"))
             "a fresh WebSocket did not echo afterwards")
        (and (string= attack "ws-burst") (/= (getf row :held) (getf row :burst-answered))
             "a first message was not answered")
        (and (string= attack "slow-read-stream")
             (> (getf row :peak-workers) (+ 2 (usable-cpus)))
             "more workers than the CPUs plus 2"))))

;;; The table

(defun run-case (kind case port &optional count)
  (when (and (string= kind "nginx") (member case *ws-attacks* :test #'string=))
    (return-from run-case nil))         ; no WebSockets, no streamed answer
  (let ((environment (append (list "BENCH_MESSAGE_LOG=1")
                             (when (string= case "silent") (list "BENCH_TIMEOUT=120"))
                             (when (uiop:string-prefix-p "ws-" case) (list "BENCH_SWITCHED=1"))
                             ;; Each server's own idle timeout, not hunchensocket's.
                             (when (string= case "ws-silent") (list "BENCH_SWITCHED_TIMEOUT=none"))
                             (when (string= case "readers, no rate")
                               (list "BENCH_GALLOP_OPTIONS=(:min-data-rate cl:nil)"))
                             (sb-ext:posix-environ)))
        (target nil))
    (unwind-protect
         (progn
           (setf target (if (string= case "tls-idle")
                            (unless (string= kind "nginx")
                              (start-target kind port (append (list "BENCH_MESSAGE_LOG=1")
                                                              (tls-environment))
                                            :tls t))
                            (start-target kind port environment
                                          :nofile (and (string= case "ws-silent") *ws-silent-fds*))))
           (cond ((string= case "silent") (attack-silent target))
                 ((string= case "slowbody") (attack-slowbody target count))
                 ((string= kind "nginx") nil) ; no handler to attack
                 ((string= case "errors") (attack-errors target))
                 ((string= case "hangups") (attack-hangups target))
                 ((string= case "uploads") (attack-uploads target))
                 ((string= case "tls-idle") (attack-tls-idle target))
                 ((string= case "readers") (attack-readers target))
                 ((string= case "readers, no rate") (attack-readers target case))
                 ((string= case "ws-fragments") (attack-ws-fragments target))
                 ((string= case "ws-broadcast") (attack-ws-broadcast target))
                 ((string= case "ws-burst") (attack-ws-burst target))
                 ((string= case "ws-silent") (attack-ws-silent target))
                 ((string= case "slow-read-stream") (attack-slow-read-stream target))))
      (when target (stop-target target)))))

(defun bar-missed (row &optional control)
  "Why a Gallop ROW misses the attack's bar, or NIL.  CONTROL: the row of the
same server's control run, for attacks that have one."
  (let ((attack (getf row :attack)))
    (cond ((member attack *ws-attacks* :test #'string=) (ws-bar-missed row))
          ((not (getf row :alive)) "the server died or stopped answering")
          ((and (string= attack "silent")
                (or (/= (getf row :answered) (getf row :probes))
                    (>= (getf row :median-ms) *goal-ms*)))
           "a probe failed or the median was too slow")
          ((and (string= attack "errors")
                (or (< (getf row :rate-ratio) 1/2) (> (getf row :log-per-error) 8192)))
           "errors were too slow or logged too much")
          ((and (string= attack "hangups") (> (getf row :rss-rise-mb) 32))
           "RSS rose more than 32 MiB")
          ((and (string= attack "slowbody")
                (or (/= (getf row :answered) (getf row :probes))
                    (>= (getf row :median-ms) *goal-ms*)))
           "a probe failed or the median was too slow")
          ((and (string= attack "slowbody") (> (getf row :peak-workers) (+ 2 (usable-cpus))))
           "more workers than the CPUs plus 2")
          ((and (string= attack "slowbody")
                (> (- (getf row :peak-rss-mb) (getf row :rest-rss-mb)) 128))
           "RSS rose past the body budget")
          ((and (string= attack "uploads")
                (or (/= 8 (getf row :uploads-answered))
                    (/= (getf row :answered) (getf row :probes))))
           "an upload or a probe was not answered")
          ((and (string= attack "uploads")
                (> (- (getf row :peak-rss-mb) (getf row :rest-rss-mb)) 32))
           "RSS rose more than 32 MiB")
          ((and (string= attack "tls-idle")
                (or (/= (getf row :tls-held) (getf row :tls-asked))
                    (> (getf row :rss-kept-mb) 20)))
           "an idle TLS connection was refused, or RSS stayed 20 MiB up once they closed")
          ((and (string= attack "readers")
                (or (plusp (getf row :held))
                    (null control)
                    ;; The control still held some at the end: it took
                    ;; longer than the whole run.
                    (and (zerop (getf control :held))
                         (>= (getf row :last-close) (getf control :last-close)))))
           "clients that read nothing were not ended sooner than in the control")
          ((and (string= attack "readers") (> (getf row :log-lines) 2))
           "more than a log line a minute about them"))))

(defun print-row (row)
  (format t "| ~A | ~A | ~A | ~D/~D | ~D | ~D | ~D | ~D | ~A | ~:[no~;yes~] | ~A |~%"
          (getf row :attack) (getf row :kind) (getf row :load)
          (getf row :answered) (getf row :probes) (getf row :median-ms) (getf row :max-ms)
          (getf row :peak-threads) (getf row :peak-rss-mb)
          (if (or (getf row :heap-start-mb) (getf row :heap-end-mb))
              (format nil "~A → ~A" (mib-or-dash (getf row :heap-start-mb))
                      (mib-or-dash (getf row :heap-end-mb)))
              "–")
          (getf row :alive) (getf row :notes))
  (finish-output))

(defun main ()
  (handler-case
      (progn
        (raise-fd-limit)
        (ensure-directories-exist *logs*)
        (format t "| attack | server | load | probes answered | median ms | max ms | peak threads | peak RSS MiB | heap after GC MiB | answering at the end | notes |~%")
        (format t "|---|---|---|--:|--:|--:|--:|--:|--:|---|---|~%")
        (let ((missed '()))
          (dolist (case *cases*)
            (dolist (count (if (string= case "slowbody") *slowbody* '(nil)))
              (loop for kind in *kinds*
                    for port from *port*
                    do (let* ((control (and (string= case "readers") (gallop-kind-p kind)
                                            (run-case kind "readers, no rate" port)))
                              (row (run-case kind case port count)))
                         (when control
                           (print-row control))
                         (when row
                           (print-row row)
                           (let ((why (and (gallop-kind-p kind) (bar-missed row control))))
                             (when why (push (format nil "~A ~A: ~A" case kind why) missed))))))))
          (format t "~%~:[Every Gallop row held its bar.~;~:*~{~A~%~}~]~%" (reverse missed))
          (uiop:quit (if missed 1 0))))
    (error (e)
      (format *error-output* "~&bench-attacks: ~A~%" e)
      (uiop:quit 2))))
