;;;; tls-hold.lisp -- `make bench-tls-hold` (also run by `make bench-tls`):
;;;; what TLS clients that do not go away cost, against each server in its own
;;;; process (issue 17).  Every server answers HTTPS with a self-signed
;;;; RSA-2048 certificate made for the run; this process is the client (cl+ssl
;;;; over sockets to 127.0.0.1).
;;;;
;;;; For each server kind (native = GALLOP:START, gallop =
;;;; GALLOP:EASY-SSL-ACCEPTOR, stock = HUNCHENTOOT:EASY-SSL-ACCEPTOR for
;;;; comparison; BENCH_TLS_KINDS lists the ones to run), default pool:
;;;;  - Idle: N (BENCH_TLS_IDLE_N, default 10,000) TLS connections, each with
;;;;    a full handshake and one GET /yo read back ("Hey!"), then left open
;;;;    and idle.  Reported: connections held, the server's pool and process
;;;;    threads, and its RSS and Lisp heap after a full GC, before and with
;;;;    them: KiB per idle TLS connection; then the clients close, and once
;;;;    the server has closed them too, its RSS after a full GC again (goal:
;;;;    within 20 MiB of before).  Stock Hunchentoot keeps a thread per
;;;;    connection; it gets BENCH_TLS_IDLE_STOCK (default 150).
;;;;  - Slowloris: 500 clients send the first 11 octets of a ClientHello and
;;;;    then nothing; 500 more complete the handshake and send a request head
;;;;    an octet a second.  Meanwhile a fresh client every 200 ms makes a full
;;;;    handshake and asks GET /yo with Connection: close: it must get exactly
;;;;    "Hey!" (status 200, Content-Length 4), within 10 s.  Reported: fresh
;;;;    clients answered, median and slowest time, how many took 50 ms or
;;;;    more, the server's threads at the most.
;;;; Exits non-zero when a Gallop server held fewer idle connections than
;;;; asked, had more than its standby + 4 pool threads, kept more than 20 MiB
;;;; of RSS once they closed, or failed a fresh client.  Traffic goes to 127.0.0.1 only, bounded in count and time.

(load (merge-pathnames "process.lisp" (directory-namestring *load-truename*)))

(defpackage #:gallop-bench-tls-hold
  (:use #:common-lisp #:gallop-bench-process)
  (:export #:main))
(in-package #:gallop-bench-tls-hold)

(require :sb-bsd-sockets)
(asdf:load-system "cl+ssl")

(defparameter *idle-n* (env-int "BENCH_TLS_IDLE_N" 10000))
(defparameter *idle-stock* (env-int "BENCH_TLS_IDLE_STOCK" 150))
(defparameter *slowloris* (env-int "BENCH_TLS_SLOWLORIS" 500) "Clients of each slowloris kind.")
(defparameter *probe-seconds* 10)
(defparameter *standby* 4 "The default pool's standby threads.")
(defparameter *kinds* (uiop:split-string (or (env "BENCH_TLS_KINDS") "native gallop stock")))
(defparameter *goal-ms* 50)

(defun crlf-text (&rest lines)
  (format nil "~{~A~C~C~}~C~C"
          (loop for l in lines append (list l #\Return #\Linefeed)) #\Return #\Linefeed))

;;; The client

(defstruct (client (:constructor make-client (socket stream))) socket stream)

(defun tls-open (port)
  "A TCP connection to 127.0.0.1:PORT with a completed TLS handshake (the
certificate not verified), or NIL."
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    (handler-case
        (progn
          (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
          (setf (sb-bsd-sockets:sockopt-tcp-nodelay socket) t)
          (make-client socket
                       (sb-sys:with-deadline (:seconds 10)
                         (cl+ssl:make-ssl-client-stream
                          (sb-bsd-sockets:socket-make-stream socket :input t :output t
                                                                    :element-type '(unsigned-byte 8))
                          :verify nil))))
      (serious-condition () (ignore-errors (sb-bsd-sockets:socket-close socket)) nil))))

(defun tls-shut (client)
  (ignore-errors (close (client-stream client) :abort t))
  (ignore-errors (sb-bsd-sockets:socket-close (client-socket client))))

(defun read-answer (stream)
  "Read one answer off STREAM: its status and body (by Content-Length), or
NIL when it is not a well-formed answer with a Content-Length."
  (let ((line (make-string-output-stream))
        (status nil) (length nil))
    (flet ((read-line-crlf ()
             (loop for b = (read-byte stream nil nil)
                   do (cond ((null b) (return nil))
                            ((= b 13) (unless (eql 10 (read-byte stream nil nil)) (return nil))
                             (return (get-output-stream-string line)))
                            (t (write-char (code-char b) line))))))
      (let ((status-line (read-line-crlf)))
        (when (and status-line (uiop:string-prefix-p "HTTP/1.1 " status-line))
          (setf status (parse-integer status-line :start 9 :end 12 :junk-allowed t))
          (loop for header = (read-line-crlf)
                while (and header (plusp (length header)))
                do (when (uiop:string-prefix-p "content-length:" (string-downcase header))
                     (setf length (parse-integer header :start 15 :junk-allowed t))))
          (when length
            (let ((body (make-array length :element-type '(unsigned-byte 8))))
              (when (= length (read-sequence body stream))
                (values status (map 'string #'code-char body))))))))))

(defun ask-yo (client &key close)
  "GET /yo on CLIENT; true when the answer is exactly 200 \"Hey!\"."
  (handler-case
      (sb-sys:with-deadline (:seconds 10)
        (let ((stream (client-stream client)))
          (write-sequence (ascii (if close
                                     (crlf-text "GET /yo HTTP/1.1" "Host: b" "Connection: close")
                                     (crlf-text "GET /yo HTTP/1.1" "Host: b")))
                          stream)
          (force-output stream)
          (multiple-value-bind (status body) (read-answer stream)
            (and (eql status 200) (equal body "Hey!")))))
    ;; A reset, or the deadline (a SERIOUS-CONDITION, not an ERROR).
    (serious-condition () nil)))

;;; The server

(defun server-environment (cert key)
  (environment-with (list (format nil "BENCH_TLS_CERT=~A" cert) (format nil "BENCH_TLS_KEY=~A" key)
                          ;; Opening 10,000 TLS connections takes longer than 20 s.
                          "BENCH_IDLE_TIMEOUT=600")))

;;; Idle

(defun run-idle (kind process pid port)
  (let* ((n (if (string= kind "stock") (min *idle-n* *idle-stock*) *idle-n*))
         (heap-before (ask-gc process))
         (rss-before (progn (sleep 0.5) (proc-status pid)))
         (clients (make-array n :fill-pointer 0))
         (failed 0)
         (start (now-ms)))
    (unwind-protect
         (progn
           (dotimes (i n)
             (let ((client (tls-open port)))
               (if (and client (ask-yo client))
                   (vector-push client clients)
                   (progn (incf failed) (when client (tls-shut client))))))
           (let* ((opened-ms (- (now-ms) start))
                  (heap-after (ask-gc process))
                  (rss-after (progn (sleep 0.5) (proc-status pid)))
                  (stats (ask-stats process))
                  (held (length clients)))
             (multiple-value-bind (rss threads) (proc-status pid)
               (declare (ignore rss))
               (let ((row (list :kind kind :asked n :held held :failed failed
                                :open (getf stats :open) :pool-threads (getf stats :threads)
                                :threads threads :opened-s (/ opened-ms 1000.0)
                                :rss-before-mib (and rss-before (/ rss-before 1024.0))
                                :rss-after-mib (and rss-after (/ rss-after 1024.0))
                                :kib-per-connection (and rss-before rss-after (plusp held)
                                                         (/ (- rss-after rss-before) held 1.0))
                                :heap-kib-per-connection (and heap-before heap-after (plusp held)
                                                              (/ (- heap-after heap-before) held 1024.0)))))
                 ;; Gone: the clients close, the server closes too.
                 (loop for c across clients do (tls-shut c))
                 (setf (fill-pointer clients) 0)
                 (loop repeat 100
                       until (<= (or (getf (ask-stats process) :open) 0) 0)
                       do (sleep 0.1))
                 ;; The server gives freed TLS memory back at most once a
                 ;; second, once its housekeeper ticks (once a second when
                 ;; no connection is open).
                 (sleep 3)
                 (ask-gc process)
                 (sleep 1)
                 (let ((rss-closed (proc-status pid)))
                   (setf (getf row :rss-closed-mib) (and rss-closed (/ rss-closed 1024.0))))
                 (format t "~&idle ~A: ~S~%" kind row)
                 (finish-output)
                 row))))
      (loop for c across clients do (tls-shut c)))))

;;; Slowloris

(defparameter *hello-start* (coerce #(22 3 1 0 200 1 0 0 196 3 3) '(simple-array (unsigned-byte 8) (*)))
  "The first octets of a ClientHello record: a handshake that never ends.")

(defun run-slowloris (kind process pid port)
  (let ((half-hellos '())
        (dribblers '())
        (dribble (ascii (crlf-text "GET /yo HTTP/1.1" "Host: b" "X-Slow: 1")))
        (probes '())
        (failed 0)
        (threads-max 0)
        (pool-max 0))
    (unwind-protect
         (progn
           (dotimes (i *slowloris*)
             (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
               (handler-case (progn (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
                                    (sb-bsd-sockets:socket-send socket *hello-start* nil)
                                    (push socket half-hellos))
                 (error () (ignore-errors (sb-bsd-sockets:socket-close socket))))))
           (dotimes (i *slowloris*)
             (let ((client (tls-open port)))
               (when client (push client dribblers))))
           (let ((done nil)
                 (position 0))
             ;; An octet a second on each dribbler, from a thread of its own.
             (let ((dribbler (sb-thread:make-thread
                              (lambda ()
                                (loop until (or done (>= position (1- (length dribble))))
                                      do (dolist (c dribblers)
                                           (ignore-errors
                                            (write-byte (aref dribble position) (client-stream c))
                                            (force-output (client-stream c))))
                                         (incf position)
                                         (loop repeat 10 until done do (sleep 0.1))))
                              :name "dribbler")))
               (unwind-protect
                    (loop with end = (+ (now-ms) (* 1000 *probe-seconds*))
                          while (< (now-ms) end)
                          do (let* ((start (now-ms))
                                    (client (tls-open port))
                                    (ok (and client (ask-yo client :close t)))
                                    (ms (- (now-ms) start)))
                               (when client (tls-shut client))
                               (if ok (push ms probes) (incf failed))
                               (multiple-value-bind (rss threads) (proc-status pid)
                                 (declare (ignore rss))
                                 (setf threads-max (max threads-max (or threads 0))))
                               (setf pool-max (max pool-max (or (getf (ask-stats process) :threads) 0)))
                               (sleep (max 0 (/ (- 200 (- (now-ms) start)) 1000.0)))))
                 (setf done t)
                 (sb-thread:join-thread dribbler :default nil)))))
      (mapc (lambda (s) (ignore-errors (sb-bsd-sockets:socket-close s))) half-hellos)
      (mapc #'tls-shut dribblers))
    (let* ((sorted (sort (copy-list probes) #'<))
           (row (list :kind kind :half-hellos (length half-hellos) :dribblers (length dribblers)
                      :probes (+ (length probes) failed) :answered (length probes) :failed failed
                      :median-ms (and sorted (nth (floor (length sorted) 2) sorted))
                      :max-ms (and sorted (car (last sorted)))
                      :over-goal (count-if (lambda (ms) (>= ms *goal-ms*)) sorted)
                      :threads-max threads-max :pool-threads-max pool-max)))
      (format t "~&slowloris ~A: ~S~%" kind row)
      (finish-output)
      row)))

;;; Main

(defun main ()
  (raise-fd-limit)
  (let* ((dir (merge-pathnames "bench/results/tmp/tls-hold/" *repo*))
         (port (env-int "BENCH_PORT" 18380))
         (idle-rows '()) (loris-rows '()) (bad '()))
    (destructuring-bind (cert key) (make-tls-certificate dir)
      (loop for kind in *kinds*
            for p from (1+ port)
            do (multiple-value-bind (process pid)
                   (start-bench-server kind p :environment (server-environment cert key)
                                              :log (merge-pathnames (format nil "~A.log" kind) dir))
                 (unwind-protect
                      (let ((warm (tls-open p)))
                        (when warm (ask-yo warm) (tls-shut warm))
                        (let ((idle (run-idle kind process pid p)))
                          (push idle idle-rows)
                          (sleep 2)
                          (let ((loris (run-slowloris kind process pid p)))
                            (push loris loris-rows)
                            (unless (string= kind "stock")
                              (when (< (getf idle :held) (getf idle :asked))
                                (push (format nil "~A held ~D of ~D idle TLS connections" kind
                                              (getf idle :held) (getf idle :asked)) bad))
                              (when (and (getf idle :rss-closed-mib) (getf idle :rss-before-mib)
                                         (> (- (getf idle :rss-closed-mib) (getf idle :rss-before-mib)) 20))
                                (push (format nil "~A kept ~,1F MiB more RSS once they closed" kind
                                              (- (getf idle :rss-closed-mib) (getf idle :rss-before-mib)))
                                      bad))
                              (when (> (or (getf idle :pool-threads) 0) (+ *standby* 4))
                                (push (format nil "~A had ~D pool threads" kind (getf idle :pool-threads)) bad))
                              (when (plusp (getf loris :failed))
                                (push (format nil "~A failed ~D fresh clients" kind (getf loris :failed)) bad))))))
                   (kill-and-reap process)))))
    (format t "~&~%| server | idle TLS connections held | pool threads | process threads | RSS before / with them / once closed (MiB) | KiB RSS per connection | KiB Lisp heap per connection | opened in |~%|---|--:|--:|--:|--:|--:|--:|--:|~%")
    (dolist (r (reverse idle-rows))
      (format t "| ~A | ~:D of ~:D | ~A | ~A | ~,1F / ~,1F / ~,1F | ~,1F | ~,1F | ~,1F s |~%"
              (getf r :kind) (getf r :held) (getf r :asked) (getf r :pool-threads) (getf r :threads)
              (getf r :rss-before-mib) (getf r :rss-after-mib) (or (getf r :rss-closed-mib) 0)
              (getf r :kib-per-connection)
              (getf r :heap-kib-per-connection) (getf r :opened-s)))
    (format t "~%| server | half ClientHellos | dribbled heads | fresh clients answered | median | slowest | ≥ ~D ms | threads at most (pool) |~%|---|--:|--:|--:|--:|--:|--:|--:|~%" *goal-ms*)
    (dolist (r (reverse loris-rows))
      (format t "| ~A | ~:D | ~:D | ~D of ~D | ~A ms | ~A ms | ~D | ~D (~D) |~%"
              (getf r :kind) (getf r :half-hellos) (getf r :dribblers) (getf r :answered) (getf r :probes)
              (getf r :median-ms) (getf r :max-ms) (getf r :over-goal) (getf r :threads-max)
              (getf r :pool-threads-max)))
    (finish-output)
    (when bad
      (format t "~&FAILED: ~{~A~^; ~}~%" (reverse bad)))
    (uiop:quit (if bad 1 0))))
