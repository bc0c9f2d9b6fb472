;;;; budget.lisp -- the head budget: connections parked with part of a
;;;; request head hold their input buffers, and clients choose how many there
;;;; are; past the engine's HEAD-BUDGET a new one gets 503 (never a heap
;;;; exhaustion), and the budget comes back as heads complete.

(in-package #:gallop-tests)

(in-suite core)

(defun check-503-answer (socket)
  "Read the whole answer on SOCKET: a 503 with Retry-After, Content-Length
equal to its body, then the server's close."
  (let ((response (read-response socket)))
    (is (and response (= 503 (response-status response))))
    (when response
      (is (equal "1" (header response "Retry-After")))
      (is (equalp "close" (header response "Connection")))
      (is (equal "503 Service Unavailable
" (body-string response)))
      (is (= (length (response-body response)) (parse-integer (header response "Content-Length")))))
    (is (closed-by-peer-p socket))))

(test partial-heads-past-the-head-budget-get-503
  (let ((buffer 8192))                  ; the size of a connection's input buffer
    (with-engine (engine port :head-budget (* 5 buffer))
      (let ((sockets '())
            (partial (format nil "GET /partial HTTP/1.1~C~CHo" #\Return #\Linefeed)))
        (unwind-protect
             (progn
               (dotimes (i 5)
                 (let ((socket (connect port)))
                   (push socket sockets)
                   (send socket partial)
                   (is (wait-until (lambda () (= (* (1+ i) buffer) (engine-stat engine :head-bytes))))
                       "connection ~D parked with its buffer counted: ~S" i
                       (engine-stat engine :head-bytes))))
               ;; The budget is spent: a sixth partial head is not kept.
               (let ((socket (connect port)))
                 (unwind-protect
                      (progn (send socket partial)
                             (check-503-answer socket))
                   (usocket:socket-close socket)))
               (is (= 1 (engine-stat engine :shed)))
               (is (= (* 5 buffer) (engine-stat engine :head-bytes)))
               ;; The five complete their heads and are served; the budget comes back.
               (dolist (socket sockets)
                 (send socket (crlf "st: x"))
                 (let ((response (read-response socket)))
                   (is (and response (= 200 (response-status response))
                            (string= "GET /partial HTTP/1.1" (body-string response))))))
               (is (wait-until (lambda () (zerop (engine-stat engine :head-bytes)))))
               ;; and a new partial head is kept again
               (let ((socket (connect port)))
                 (push socket sockets)
                 (send socket partial)
                 (is (wait-until (lambda () (= buffer (engine-stat engine :head-bytes)))))))
          (mapc #'usocket:socket-close sockets))
        ;; closed connections give their share back too
        (is (wait-until (lambda () (zerop (engine-stat engine :head-bytes)))))))))

(test a-head-buffer-does-not-grow-past-the-head-budget
  ;; A 20 KB head needs the buffer grown past 8 KiB; with 12,000 octets of
  ;; budget it is not, and the answer is 503 (not 431: the head is under
  ;; MAX-HEAD-BYTES).  The same head is served with budget to spare.
  (let ((head (raw-lines "GET /long HTTP/1.1" "Host: x"
                         (format nil "X-Long: ~A" (make-string 20000 :initial-element #\a)))))
    (with-engine (engine port :head-budget 12000 :max-head-bytes 65536)
      (let ((socket (connect port)))
        (unwind-protect
             (progn (send socket head)
                    (check-503-answer socket))
          (usocket:socket-close socket))))
    (with-engine (engine port :max-head-bytes 65536)
      (let ((response (request port head)))
        (is (and response (= 200 (response-status response))
                 (string= "GET /long HTTP/1.1" (body-string response))))))))
