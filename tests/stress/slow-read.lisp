;;;; slow-read.lisp -- `slowhttptest -X` (slow read) against a route that
;;;; streams a 1 MiB answer, on both front ends, each in a child process with
;;;; default settings (tests/child/stream-server.lisp), beside a fresh client
;;;; that asks GET /yo twice a second.  A handler streaming to a slow reader
;;;; finishes while the rest of its answer waits in epoll (http/output-queue.lisp,
;;;; Output), so however many readers there are: every fresh client is
;;;; answered, exactly, their median within 50 ms; the pool grows no larger
;;;; than the CPUs + 2 (or its standby count, under which it never goes);
;;;; and once the readers are gone the memory account's :OUTPUT is back to 0.
;;;; A server whose writers waited for their readers would hold a worker per
;;;; reader, and the pool would grow toward its 100.  The readers read 32
;;;; octets every 5 s, under the minimum data rate, which closes them in
;;;; time; or 1 KiB a second, above it, which does not: their answers then
;;;; fill the memory account until the overload manager closes the
;;;; largest holders.

(in-package #:gallop-tests)

(in-suite stress)

(defparameter *slow-read-seconds* 30
  "How long slowhttptest runs against each front end, readers under the
minimum rate.")

(defparameter *fast-slow-read-seconds* 20
  "How long it runs with readers above the minimum rate.")

(defun stream-server-log (kind)
  (merge-pathnames (format nil "stream-server-~A.log" kind) (run-directory)))

(defun start-stream-server (kind)
  "Start tests/child/stream-server.lisp with KIND, its log to
STREAM-SERVER-LOG; return the process, its port and its pid."
  (let* ((process (sb-ext:run-program
                   "scripts/lisp.sh" (list "--load" "tests/child/stream-server.lisp"
                                           "--end-toplevel-options" kind)
                   :search t :wait nil :input :stream :output :stream
                   :error (namestring (stream-server-log kind)) :if-error-exists :supersede
                   :directory (asdf:system-source-directory "gallop")))
         (line (read-line (sb-ext:process-output process) nil "")))
    (values process
            (and (uiop:string-prefix-p "READY " line) (parse-integer line :start 6))
            (sb-ext:process-pid process))))

(defun process-threads (pid)
  "The threads of the process PID, from /proc."
  (with-open-file (in (format nil "/proc/~D/status" pid) :if-does-not-exist nil)
    (and in (loop for line = (read-line in nil) while line
                  when (uiop:string-prefix-p "Threads:" line)
                    return (parse-integer line :start 8 :junk-allowed t)))))

(defun probe-yo-ms (port)
  "A fresh client: GET /yo with Connection: close, read strictly.
Milliseconds to the whole answer when it is exactly 200 \"Yo!\", else NIL."
  (let ((start (get-internal-real-time)))
    (handler-case
        (let ((socket (connect port :timeout 10)))
          (unwind-protect
               (progn (send socket (crlf "GET /yo HTTP/1.1" "Host: p" "Connection: close"))
                      (let ((r (read-wire socket :close t)))
                        (and (= 200 (wire-status r))
                             (string= "Yo!" (wire-body-string r))
                             (round (* 1000 (- (get-internal-real-time) start))
                                    internal-time-units-per-second))))
            (usocket:socket-close socket)))
      (error () nil))))

(defun median-of (numbers)
  (if numbers (nth (floor (length numbers) 2) (sort (copy-list numbers) #'<)) 0))

(defun slow-read-against (kind &key (read-interval 5) (read-octets 32)
                                     (seconds *slow-read-seconds*))
  "Run slowhttptest -X for SECONDS against KIND's /stream with the probe
and the samplers, its readers reading READ-OCTETS every READ-INTERVAL
seconds; check what the header says."
  (raise-test-fd-limit)
  (multiple-value-bind (process port pid) (start-stream-server kind)
    (unwind-protect
         (progn
           (is (integerp port) "the ~A child server did not start" kind)
           (when (integerp port)
             ;; Warm up: a fresh SBCL's first answers compile dispatch code.
             (probe-yo-ms port)
             (fetch-stream port)
             (let* ((done nil) (latencies '()) (failures 0)
                    (peak-pool 0) (peak-threads 0) (peak-output 0) (peak-waiting 0)
                    (output nil)
                    (attacker (sb-thread:make-thread
                               (lambda ()
                                 (setf output
                                       (uiop:run-program
                                        (list "slowhttptest" "-X" "-c" "500" "-r" "100"
                                              "-w" "512" "-y" "1024"
                                              "-n" (princ-to-string read-interval)
                                              "-z" (princ-to-string read-octets)
                                              "-k" "3" "-p" "3"
                                              "-l" (princ-to-string seconds)
                                              "-u" (format nil "http://127.0.0.1:~D/stream" port))
                                        :output :string :error-output :output
                                        :ignore-error-status t)))
                               :name "slowhttptest"))
                    (sampler (sb-thread:make-thread
                              (lambda ()
                                (loop until done
                                      do (let ((stats (and (sb-ext:process-alive-p process)
                                                           (child-stats process))))
                                           (setf peak-pool (max peak-pool (or (getf stats :threads) 0))
                                                 peak-waiting (max peak-waiting
                                                                   (or (getf stats :waiting-writers) 0))
                                                 peak-output (max peak-output
                                                                  (or (getf (getf stats :memory) :output) 0))
                                                 peak-threads (max peak-threads
                                                                   (or (process-threads pid) 0))))
                                         (sleep 0.25)))
                              :name "sampler")))
               (loop while (sb-thread:thread-alive-p attacker)
                     do (let ((ms (probe-yo-ms port)))
                          (if ms (push ms latencies) (incf failures)))
                        (sleep 0.5))
               (setf done t)
               (sb-thread:join-thread sampler)
               (let ((stats (child-stats process))
                     ;; USABLE-CPUS (os/cpus.lisp, internal): the CPUs the
                     ;; pool sizes itself by, which the bound follows.
                     (bound (max (+ (ceiling (gallop.core::usable-cpus)) 2)
                                 (eval (gallop.core:setting-default standby-thread-count)))))
                 (format t "~&    slow read, ~(~A~): ~D probes, ~D failed, median ~D ms, max ~D ms; ~
                            pool threads at most ~D, process threads ~D; :output at most ~,1F MiB, ~
                            waiting writers at most ~D, ~D shed; ~D closed by the overload manager, ~
                            ~D write timeouts (~D slow clients)~%"
                         kind (+ failures (length latencies)) failures (median-of latencies)
                         (reduce #'max latencies :initial-value 0) peak-pool peak-threads
                         (/ peak-output 1048576.0) peak-waiting (getf stats :writers-shed)
                         (getf stats :overload-shed) (getf stats :write-timeouts)
                         (getf stats :slow-clients))
                 (is (search "slow HTTP test status" output) "slowhttptest ran: ~A" output)
                 (is (sb-ext:process-alive-p process) "the ~A server died: ~A" kind
                     (uiop:read-file-string (stream-server-log kind)))
                 (is (plusp (length latencies)))
                 (is (zerop failures) "~D of ~D fresh clients not answered"
                     failures (+ failures (length latencies)))
                 (is (<= (median-of latencies) 50) "median ~D ms" (median-of latencies))
                 (is (<= peak-pool bound) "pool threads: ~D, bound ~D" peak-pool bound)
                 ;; Its readers gone, nothing of theirs is held.
                 (is-true (wait-until (lambda ()
                                        (let ((stats (child-stats process)))
                                          (and (eql 0 (getf stats :open))
                                               (eql 0 (getf (getf stats :memory) :output)))))
                                      :timeout 30)
                          "still held: ~S" (child-stats process))))))
      (end-child-server process))))

(defun fetch-stream (port)
  "GET /stream on a fresh connection, read whole (warming up)."
  (ignore-errors
   (let ((socket (connect port :timeout 10)))
     (unwind-protect
          (progn (send socket (crlf "GET /stream HTTP/1.1" "Host: p" "Connection: close"))
                 (read-wire socket :close t))
       (usocket:socket-close socket)))))

(test slowhttptest-slow-read-of-a-streamed-answer-native
  "slowhttptest -X against GALLOP:START's streaming writer."
  (slow-read-against "native"))

(test slowhttptest-slow-read-of-a-streamed-answer-easy-acceptor
  "slowhttptest -X against a Hunchentoot handler writing to SEND-HEADERS's
stream on GALLOP:EASY-ACCEPTOR."
  (slow-read-against "easy-acceptor"))

(test slowhttptest-slow-read-above-the-minimum-rate-native
  "slowhttptest -X, its readers above the minimum rate, against GALLOP:START's
streaming writer."
  (slow-read-against "native" :read-interval 1 :read-octets 1024
                              :seconds *fast-slow-read-seconds*))

(test slowhttptest-slow-read-above-the-minimum-rate-easy-acceptor
  "slowhttptest -X, its readers above the minimum rate, against a
Hunchentoot handler writing to SEND-HEADERS's stream."
  (slow-read-against "easy-acceptor" :read-interval 1 :read-octets 1024
                                     :seconds *fast-slow-read-seconds*))
